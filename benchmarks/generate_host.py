"""The host's cost of a monitored decoding step: a CPU proxy for `generate` on a GPU.

On a GPU a decoding step of a 1-8B model is bound by the host (launches and Python), so what
the monitor adds there is what it adds to the host's work per step. This measures that on the
CPU, on a 16-layer Llama of width 256 (intermediate 512, 4 heads, 2 kv heads, vocab 512, random
weights, float32, one thread): batch 4, 16 prompt + 128 new tokens, greedy, through the public
API (``eh.monitor``) only.

- thread CPU time (``time.thread_time``) of ``model.generate`` monitored / plain, two copies of
  the same weights, interleaved; the median of the paired ratios (goal <= 1.04);
- per decoding step, with the prefill and the flushes of the buffered steps amortised (the
  monitor is entered once and one generate is counted after a warm one, so the counted run
  flushes exactly one generate's buffered steps): the extra launching aten ops (a
  ``TorchDispatchMode`` leaving out views and allocations, as ``monitor_ops.py``; goal <= 6; also
  counted as the CUDA path makes them, forced on the CPU: one stacked group, a flush one bmm a point),
  the calls of the monitor's hook functions, and Python function calls (``sys.setprofile``,
  'call' and 'c_call' events), monitored minus plain.

Usage: PYTHONPATH=. python benchmarks/generate_host.py [--pairs 15] [--quick] [--width 256]   (from the repository root)
"""

from __future__ import annotations

import argparse
import copy
import importlib
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check as gc  # noqa: E402
from monitor_ops import NO_LAUNCH  # noqa: E402

SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=16, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, head_dim=64)  # fmt: skip
GOAL_RATIO, GOAL_OPS = 1.04, 6  # issue 39


class Launches(TorchDispatchMode):
    """Counts the aten ops that launch a kernel on a GPU (views and allocations left out)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in NO_LAUNCH:
            self.n += 1
        return func(*args, **(kwargs or {}))


class Calls:
    """sys.setprofile counter: every Python and C function call, and calls of the given code objects."""

    def __init__(self, codes=frozenset()):
        self.codes, self.calls, self.c_calls, self.hooks = codes, 0, 0, 0

    def __call__(self, frame, event, arg):
        if event == "call":
            self.calls += 1
            if frame.f_code in self.codes:
                self.hooks += 1
        elif event == "c_call":
            self.c_calls += 1

    def __enter__(self):
        sys.setprofile(self)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)


def _hook_dicts(model) -> dict:
    """Every forward hook and pre-hook of the model's modules and torch's global ones: {id: callable}."""
    out = {}
    for mod in model.modules():
        for name in ("_forward_hooks", "_forward_pre_hooks"):
            for h in getattr(mod, name).values():
                out[id(h)] = h
    from torch.nn.modules import module as M

    for d in (M._global_forward_hooks, M._global_forward_pre_hooks):
        for h in d.values():
            out[id(h)] = h
    return out


def _code(h):
    while hasattr(h, "func"):  # functools.partial
        h = h.func
    return getattr(getattr(h, "__func__", h), "__code__", None)


def add_proxy_args(p: argparse.ArgumentParser) -> None:
    """The proxy's shape, as every benchmark that runs it takes it (``build``)."""
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--width", type=int, default=SHAPE["hidden_size"], help="hidden size (the MLP twice it)")


def build(args):
    """The proxy model and its generate's arguments; ``args.width``, when given, sets SHAPE's width first."""
    if getattr(args, "width", None):
        SHAPE.update(hidden_size=args.width, intermediate_size=2 * args.width, head_dim=args.width // 4)
    model = gc.build_shape(SHAPE, "cpu", torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params < 12_000_000, f"the proxy model is meant to be small (~9.7M); {n_params=}"
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, SHAPE["vocab_size"], (args.batch, args.prompt), generator=g)
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new,
              min_new_tokens=args.new, do_sample=False, pad_token_id=0)  # fmt: skip
    return model, kw


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", type=int, default=15)
    p.add_argument("--quick", action="store_true", help="smoke run: 3 pairs, 16 new tokens")
    add_proxy_args(p)
    a = p.parse_args(argv)
    if a.quick:
        a.pairs, a.new = 3, 16
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    import eigenhooks as eh

    model, kw = build(a)
    plain = copy.deepcopy(model)
    gen = lambda m: m.generate(**kw)  # noqa: E731
    before = _hook_dicts(model)
    with torch.no_grad(), eh.monitor(model) as mon:
        codes = frozenset(filter(None, (_code(h) for k, h in _hook_dicts(model).items() if k not in before)))
        out_m, out_p = gen(model), gen(plain)  # warm: constants made, one generate's steps buffered
        assert torch.equal(out_m, out_p), "the monitored model generated other tokens than its plain copy"
        counts = {}
        for name, m in (("plain", plain), ("monitored", model)):
            gen(m)
            with Launches() as ops:  # each counted generate flushes the previous one's buffered steps
                gen(m)
            with Calls(codes) as calls:  # apart: the dispatch mode's own Python calls are not counted
                gen(m)
            counts[name] = (ops.n, calls.hooks, calls.calls + calls.c_calls)
        counts["cuda"] = _cuda_path_ops(plain, gen)
        ratios, tp, tm = [], [], []
        for i in range(a.pairs):  # interleaved, the order alternating, so drift hits both
            order = [(plain, tp), (model, tm)] if i % 2 == 0 else [(model, tm), (plain, tp)]
            for m, times in order:
                t0 = time.thread_time()
                gen(m)
                times.append(time.thread_time() - t0)
            ratios.append(tm[-1] / tp[-1])
    assert mon.summary()["n_tokens"].min() > 0, "the monitor counted no tokens"
    _report(a, ratios, tp, tm, counts)
    return 0


def _cuda_path_ops(model, gen) -> int:
    """The launching ops of one generate as the CUDA path makes them, counted on the CPU: every layer padded
    into one stacked group (``pad_to_stack(widen_frames=True)``, as a plan on CUDA) and a flush's matmuls one
    bmm a reading point (``reduce.batched.BMM_DEVICES``). Its numbers are not the CPU path's bits."""
    import eigenhooks as eh

    plan = importlib.import_module("eigenhooks.monitor.plan")
    batched = importlib.import_module("eigenhooks.monitor.reduce.batched")
    pad, devices = plan.pad_to_stack, batched.BMM_DEVICES
    plan.pad_to_stack = lambda bases, widen_frames=False: pad(bases, widen_frames=True)
    batched.BMM_DEVICES = devices | {"cpu"}
    try:
        model = copy.deepcopy(model)
        with eh.monitor(model):
            gen(model)
            gen(model)
            with Launches() as ops:
                gen(model)
    finally:
        plan.pad_to_stack, batched.BMM_DEVICES = pad, devices
    return ops.n


def _report(a, ratios, tp, tm, counts) -> None:
    steps = a.new  # forwards per generate: the prefill and new - 1 single-token steps; the flush amortised
    L = SHAPE["num_hidden_layers"]
    med = statistics.median(ratios)
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (med, med, med)
    dp, dm = statistics.median(tp), statistics.median(tm)
    extra_us = (dm - dp) / steps * 1e6
    (op_p, hk_p, py_p), (op_m, hk_m, py_m) = counts["plain"], counts["monitored"]
    import eigenhooks

    print(f"generate host cost: {L}-layer Llama width {SHAPE['hidden_size']}, batch {a.batch}, "
          f"{a.prompt} + {a.new} tokens, float32, 1 thread, {len(ratios)} interleaved pairs; "
          f"code: {Path(eigenhooks.__file__).parent}")  # fmt: skip
    print(f"  thread CPU time monitored / plain, median paired ratio: {med:.3f} "
          f"(quartiles {q1:.3f}-{q3:.3f})  goal <= {GOAL_RATIO}  {'met' if med <= GOAL_RATIO else 'NOT met'}")  # fmt: skip
    print(f"  plain {dp * 1e3:.1f} ms a generate ({dp / steps * 1e3:.3f} ms a step); monitored +{extra_us:.0f} us "
          f"a step, +{extra_us / L:.1f} us a layer and step")  # fmt: skip
    print(f"per decoding step ({steps} forwards a generate, prefill and flushes amortised), monitored - plain:")
    ops = (op_m - op_p) / steps
    print(f"  launching aten ops: +{ops:.2f} (plain {op_p / steps:.1f})  goal <= {GOAL_OPS}  "
          f"{'met' if ops <= GOAL_OPS else 'NOT met'}")  # fmt: skip
    cuda = (counts["cuda"] - op_p) / steps
    print(f"    the CUDA path (one stacked group, a flush's matmuls one bmm a point; forced here): +{cuda:.2f}")
    print(f"  monitor hook calls: {(hk_m - hk_p) / steps:.2f}")
    print(f"  Python function calls (call + c_call): +{(py_m - py_p) / steps:.0f} (plain {py_p / steps:.0f})")


if __name__ == "__main__":
    sys.exit(main())
