"""No host synchronisation inside a monitored forward or generation step (docs/design.md, "Architecture").

On a GPU, reading a value back (``.item()``, ``.tolist()``, ``.cpu()``, ``bool(t)``), a
data-dependent shape (``nonzero``, boolean-mask indexing) or a tensor made from host data and
moved over (``torch.tensor(list)``, an index list) each stall the host until the device catches
up. This CPU test records every aten op and every such Tensor method called from eigenhooks'
own code between a forward's start and its end, and fails on any of them. ``summary()`` may
read back; it runs outside the window. ``benchmarks/gpu_check.py`` runs the same forwards on a
GPU under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import eigenhooks as eh

PKG = os.path.dirname(eh.__file__)
# aten ops that read a value back to the host or whose output shape depends on data
BANNED = {"aten::_local_scalar_dense", "aten::nonzero", "aten::nonzero_static", "aten::masked_select", "aten::unique"}
# ops that turn host data into a tensor (an HtoD copy on a GPU)
FROM_HOST = {"aten::lift_fresh", "aten::lift", "aten::lift_fresh_copy"}
INDEXING = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}


def _ours() -> str | None:
    """The innermost eigenhooks frame calling this op, as 'file:line', or None."""
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_name == "generate" and f.f_code.co_filename.endswith("hooks.py"):
            return None  # the monitor's wrapper of model.generate: what generate itself runs is not ours
        if f.f_code.co_filename.startswith(PKG):
            return f"{os.path.relpath(f.f_code.co_filename, PKG)}:{f.f_lineno}"
        f = f.f_back
    return None


class SyncTrap(TorchDispatchMode):
    """Records, per op or method, where in eigenhooks it was called while a forward runs."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, str]] = []
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        where = _ours()
        if where is not None:
            self.ops += 1
            if name in BANNED or name in FROM_HOST:
                self.seen.append((name, where))
            elif name in INDEXING:
                idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
                if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx or ()):
                    self.seen.append((name + " (boolean mask)", where))
        return func(*args, **kwargs)


@contextlib.contextmanager
def trapped():
    """Dispatch-mode recording plus traps on the Tensor methods that bypass dispatch on the CPU."""
    trap = SyncTrap()
    saved = {}

    def wrap(meth):
        orig = getattr(torch.Tensor, meth)

        def f(self, *a, **k):
            where = _ours()
            # .to(x.device) moves to the activations' device (a no-op here); .to("cpu") reads back
            to_host = meth != "to" or any(
                isinstance(x, str) and torch.device(x).type == "cpu" for x in (*a, k.get("device"))
            )
            if where is not None and to_host:
                trap.seen.append((f"Tensor.{meth}", where))
            return orig(self, *a, **k)

        saved[meth] = orig
        setattr(torch.Tensor, meth, f)

    for meth in ("tolist", "cpu", "numpy", "item", "to"):
        wrap(meth)
    try:
        with trap:
            yield trap
    finally:
        for meth, orig in saved.items():
            setattr(torch.Tensor, meth, orig)


def _check(trap: SyncTrap):
    assert trap.ops > 50, "the trap saw none of the monitor's work: it tests nothing"
    assert not trap.seen, "host syncs inside a monitored forward:\n" + "\n".join(f"{n} at {w}" for n, w in trap.seen)


@pytest.fixture(scope="module")
def gpt2():
    model, tok = eh.zoo.load("gpt2-tiny")
    tok.pad_token = tok.pad_token or tok.eos_token
    return model, tok


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_monitored_forward_reads_nothing_back(gpt2, side):
    model, tok = gpt2
    tok.padding_side = side
    batch = tok(["def f(x):\n    return x", "class A: pass", "import os"], return_tensors="pt", padding=True)
    tok.padding_side = "right"
    with eh.monitor(model) as mon, torch.no_grad():
        with trapped() as trap:
            model(**batch)  # the first forward too: the device constants are made at entry
            model(**batch)
            model(**batch)  # and one that ends the previous forward's sequences first
    _check(trap)
    assert mon.n_forwards == 3 and mon.summary()["n_tokens"].iloc[0] == 3 * int(batch["attention_mask"].sum())


def test_generation_steps_and_their_flush_read_nothing_back(gpt2):
    model, tok = gpt2
    tok.padding_side = "left"
    batch = tok(["def f(x):", "class A:"], return_tensors="pt", padding=True)
    tok.padding_side = "right"
    with eh.monitor(model) as mon, torch.no_grad(), trapped() as trap:
        # 2 sequences x 130 steps: past BUFFER_TOKENS (256), so buffered steps are reduced inside a forward
        model.generate(**batch, max_new_tokens=130, min_new_tokens=130, do_sample=False, pad_token_id=tok.eos_token_id)
    _check(trap)
    assert mon.n_forwards == 130


def test_a_post_norm_model_reads_nothing_back():
    model, tok = eh.zoo.load("albert-tiny")
    batch = tok(["The for statement iterates", "over a sequence"], return_tensors="pt", padding=True)
    with eh.monitor(model) as mon, torch.no_grad():
        with trapped() as trap:
            model(**batch)
            model(**batch)
    _check(trap)
    assert mon.n_forwards == 2


def test_the_trap_catches_each_kind_of_sync():
    """The trap itself: every kind of read-back, called from eigenhooks' code, is caught."""
    x = torch.arange(6.0)
    # run each probe from a frame whose file is inside the package, as a hook's code would be
    inside = compile("probe()", os.path.join(PKG, "monitor", "reduce", "projection.py"), "exec")
    kinds = {
        "aten::_local_scalar_dense": lambda: x.sum().item(),
        "aten::nonzero": lambda: torch.nonzero(x),
        "Tensor.tolist": lambda: x.tolist(),
        "Tensor.cpu": lambda: x.cpu(),
        "aten::lift_fresh": lambda: torch.tensor([1, 2]),
        "aten::index (boolean mask)": lambda: x[x > 2],
    }
    for name, fn in kinds.items():
        with trapped() as trap:
            exec(inside, {"probe": fn})
        assert any(n == name for n, _ in trap.seen), (name, trap.seen)
        with trapped() as trap:
            fn()  # the same call from outside the package is not ours
        assert not trap.seen, (name, trap.seen)
