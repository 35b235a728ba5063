"""Composition with other tools: the same edit gives the same statistics in any order.

Every test compares the monitor with a reference built here, from this file's own forward
hooks on the modules that consume each state (the attention's norm, the MLP's norm, the
next norm): what the model really formed under the edit, whoever made it and whenever it
was registered. gamma and rho are recomputed from those tensors for a custom target.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from harness import build

import eigenhooks as eh
from eigenhooks.models.base import Tap
from eigenhooks.monitor.stats import GROWTH_EPS

FAMILIES = ("gpt2", "llama")
COLS = ("gamma_pre", "gamma_mid", "gamma_post", "rho")


def _parts(model):
    """[(block, attention's norm, MLP's norm, attention)] and the final norm, for GPT-2 and Llama."""
    if hasattr(model, "transformer"):
        t = model.transformer
        return [(b, b.ln_1, b.ln_2, b.attn) for b in t.h], t.ln_f
    m = model.model
    return [(b, b.input_layernorm, b.post_attention_layernorm, b.self_attn) for b in m.layers], m.norm


class Reference:
    """What each consumer module really received, read by forward hooks of our own (after any
    pre-hook of anyone's has run), and gamma / rho of a target recomputed from it."""

    def __init__(self, model):
        layers, final = _parts(model)
        self.got: dict = {}
        self.handles = []
        for i, (_, ln_a, ln_m, _) in enumerate(layers):
            self._grab(ln_a, ("pre", i))
            self._grab(ln_m, ("mid", i))
        self._grab(final, ("post", len(layers) - 1))
        self.n = len(layers)

    def _grab(self, module, key):
        def fn(m, args, output):
            self.got[key] = args[0].detach().double()

        self.handles.append(module.register_forward_hook(fn))

    def remove(self):
        for h in self.handles:
            h.remove()

    def stats(self, U: torch.Tensor, mask: torch.Tensor) -> dict:
        """{layer: {gamma_pre, gamma_mid, gamma_post, rho, n_tokens}} over the mask's tokens."""
        U, m = U.double(), mask.bool()
        a = lambda x: (
            torch.linalg.vector_norm(x @ U.reshape(U.shape[0], -1), dim=-1) / torch.linalg.vector_norm(x, dim=-1)
        )
        out = {}
        for i in range(self.n):
            pre, mid = self.got[("pre", i)], self.got[("mid", i)]
            post = self.got[("pre", i + 1)] if i + 1 < self.n else self.got[("post", i)]
            a_pre, a_mid, a_post = a(pre)[m], a(mid)[m], a(post)[m]
            out[i] = {
                "gamma_pre": float(a_pre.mean()),
                "gamma_mid": float(a_mid.mean()),
                "gamma_post": float(a_post.mean()),
                "rho": float(((a_mid - a_pre) > GROWTH_EPS).double().mean()),
                "n_tokens": int(m.sum()),
            }
        return out


def _target(d: int, seed: int = 3) -> torch.Tensor:
    Q, _ = torch.linalg.qr(torch.randn(d, 2, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return Q  # (d, 2) orthonormal: a custom target with k = 2


def _monitor(model, U):
    return eh.monitor(model, targets=[("probe", U)], null_draws=8, fnull_draws=0, eig_top=0)


def _agree(mon, ref: dict, tol: float = 2e-5):
    df = mon.summary().set_index("layer")
    for i, r in ref.items():
        assert int(df.loc[i, "n_tokens"]) == r["n_tokens"], i
        for c in COLS:
            assert abs(df.loc[i, c] - r[c]) < tol, (i, c, df.loc[i, c], r[c])


def _batch(model):
    """Two sequences, the first left-padded by 2: only the mask's tokens count."""
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _scaled_block_input(block):
    """A forward pre-hook replacing block's residual input by 3 x + 1 (positional or keyword)."""

    def fn(m, args, kwargs):
        if args:
            return (args[0] * 3.0 + 1.0, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"] * 3.0 + 1.0}

    return block.register_forward_pre_hook(fn, with_kwargs=True)


def _zeroed_output(attn):
    return attn.register_forward_hook(lambda m, a, o: (torch.zeros_like(o[0]), *o[1:]))


def _run(model, edit, monitor_first: bool):
    """(monitor, reference stats, reference of the unedited model) with `edit` registered
    before the monitor enters or after."""
    batch, U = _batch(model), _target(model.config.hidden_size)
    ref = Reference(model)  # registered first of all: ordering cannot favour it
    handles = []
    try:
        if not monitor_first:
            handles.append(edit())
        with _monitor(model, U) as mon:
            if monitor_first:
                handles.append(edit())
            with torch.no_grad():
                model(**batch)
        for h in handles:
            h.remove()
        edited = ref.stats(U, batch["attention_mask"])
        with torch.no_grad():
            model(**batch)
        plain = ref.stats(U, batch["attention_mask"])
    finally:
        for h in handles:
            h.remove()
        ref.remove()
    return mon, edited, plain


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request):
    return build(request.param, dtype=torch.float32)


@pytest.mark.parametrize("monitor_first", [True, False], ids=["edit-after", "edit-before"])
def test_pre_hook_replacing_a_block_input(tiny, monitor_first):
    block = _parts(tiny)[0][1][0]
    mon, ref, plain = _run(tiny, lambda: _scaled_block_input(block), monitor_first)
    _agree(mon, ref)
    assert abs(ref[1]["gamma_pre"] - plain[1]["gamma_pre"]) > 1e-3  # the edit changes what layer 1 receives
    assert abs(ref[0]["gamma_post"] - plain[0]["gamma_post"]) > 1e-3  # and what layer 0 hands on


@pytest.mark.parametrize("monitor_first", [True, False], ids=["edit-after", "edit-before"])
def test_forward_hook_zeroing_an_attention_output(tiny, monitor_first):
    attn = _parts(tiny)[0][1][3]
    mon, ref, plain = _run(tiny, lambda: _zeroed_output(attn), monitor_first)
    _agree(mon, ref)
    assert ref[1]["rho"] == 0.0 and abs(ref[1]["gamma_mid"] - ref[1]["gamma_pre"]) < 1e-12  # no attention step
    assert plain[1]["rho"] > 0.0


def test_reading_at_the_block_input_would_be_stale(tiny):
    """The check above can fail: an adapter reading pre at the block's own input (where an
    earlier version read it) misses a pre-hook registered after the monitor."""
    ad = eh.get_adapter(tiny)
    orig = ad.reading_points
    ad.reading_points = lambda i: dataclasses.replace(orig(i), pre=Tap(ad.layers[i].block, "input"))
    block = _parts(tiny)[0][1][0]
    batch, U = _batch(tiny), _target(tiny.config.hidden_size)
    ref = Reference(tiny)
    try:
        with eh.monitor(ad, targets=[("probe", U)], null_draws=8, fnull_draws=0, eig_top=0) as mon:
            h = _scaled_block_input(block)
            with torch.no_grad():
                tiny(**batch)
            h.remove()
    finally:
        ref.remove()
    with pytest.raises(AssertionError):
        _agree(mon, ref.stats(U, batch["attention_mask"]))


# ---- nnsight 0.8 ----


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_nnsight_input_assignment(tiny, where):
    nnsight = pytest.importorskip("nnsight")
    net = nnsight.NNsight(tiny)
    layers = net.transformer.h if hasattr(tiny, "transformer") else net.model.layers
    batch, U = _batch(tiny), _target(tiny.config.hidden_size)
    ref = Reference(tiny)
    box = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", eh.MeasurementWarning)
            if where == "outside":
                with _monitor(tiny, U) as mon, torch.no_grad():
                    with net.trace(**batch):
                        layers[1].input = layers[1].input * 3.0 + 1.0
            else:
                with torch.no_grad(), net.trace(**batch):
                    with _monitor(tiny, U) as inner:  # the trace's body runs within the model's forward
                        box["mon"] = inner
                        layers[1].input = layers[1].input * 3.0 + 1.0
                mon = box["mon"]
        edited = ref.stats(U, batch["attention_mask"])
        with torch.no_grad():
            tiny(**batch)
        plain = ref.stats(U, batch["attention_mask"])
    finally:
        ref.remove()
    _agree(mon, edited)
    assert abs(edited[1]["gamma_pre"] - plain[1]["gamma_pre"]) > 1e-3
    count = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in tiny.modules())
    assert count == 0, "the monitor's hooks came off once the forward it waited for returned"


# ---- baukit ----


class BaukitStyleTraceDict:
    """The hook pattern of baukit's ``TraceDict(model, layers, edit_output=fn)``: one forward
    hook per named module returning ``edit_output(output, layer)`` (baukit is not installable here)."""

    def __init__(self, model, layers, edit_output):
        mods = dict(model.named_modules())
        self.handles = [
            mods[name].register_forward_hook(lambda m, i, o, name=name: edit_output(o, name)) for name in layers
        ]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def _baukit_edit(output, layer):
    """Halve an attention output; shift a block output by a fixed vector."""
    if layer.endswith(("attn", "self_attn")):
        return (output[0] * 0.5, *output[1:])
    h = output[0] if isinstance(output, tuple) else output
    shift = torch.linspace(-1.0, 1.0, h.shape[-1], dtype=h.dtype)
    return (h + shift, *output[1:]) if isinstance(output, tuple) else h + shift


def test_baukit_style_output_edits_registered_after_the_monitor(tiny):
    gpt = hasattr(tiny, "transformer")
    names = ["transformer.h.0", "transformer.h.1.attn"] if gpt else ["model.layers.0", "model.layers.1.self_attn"]
    batch, U = _batch(tiny), _target(tiny.config.hidden_size)
    ref = Reference(tiny)
    try:
        with _monitor(tiny, U) as mon:
            with BaukitStyleTraceDict(tiny, names, _baukit_edit), torch.no_grad():
                tiny(**batch)
        edited = ref.stats(U, batch["attention_mask"])
        with torch.no_grad():
            tiny(**batch)
        plain = ref.stats(U, batch["attention_mask"])
    finally:
        ref.remove()
    _agree(mon, edited)
    assert abs(edited[0]["gamma_post"] - plain[0]["gamma_post"]) > 1e-3  # block 0's output edit is seen
    assert abs(edited[1]["gamma_mid"] - plain[1]["gamma_mid"]) > 1e-3  # layer 1's attention edit is seen


# ---- real weights ----


@pytest.mark.real
def test_real_edits_in_either_order(smollm2):
    model, _ = smollm2
    layers, _ = _parts(model)
    block, attn = layers[4][0], layers[7][3]

    def both():
        h1, h2 = _scaled_block_input(block), _zeroed_output(attn)
        return type("H", (), {"remove": lambda self: (h1.remove(), h2.remove())})()

    runs = [_run(model, both, first) for first in (True, False)]
    for mon, ref, plain in runs:
        _agree(mon, ref, tol=1e-4)
        assert ref[7]["rho"] == 0.0 and plain[7]["rho"] > 0
        assert abs(ref[4]["gamma_pre"] - plain[4]["gamma_pre"]) > 1e-4


# ---- TransformerLens 4 bridge: run_with_hooks lists ----


def test_lens_hook_resid_pre_edit_listed_before_or_after_the_monitor():
    tl = pytest.importorskip("transformer_lens")
    model, tok = eh.zoo.load("gpt2-tiny")
    bridge = tl.TransformerBridge.boot_transformers("gpt2", hf_model=model, tokenizer=tok, dtype=torch.float32)
    ids = tok(["def f(x):\n    return x * 2"], return_tensors="pt")["input_ids"]
    U = _target(bridge.cfg.d_model)
    edit = ("blocks.1.hook_resid_pre", lambda act, hook: act * 3.0 + 1.0)
    got = {}
    own = ("blocks.1.ln1.hook_in", lambda act, hook: got.__setitem__("pre", act.detach().double()))
    out = {}
    for order in ("before", "after", "plain"):
        mon = eh.monitor(bridge, targets=[("probe", U)], attach=False, null_draws=8, fnull_draws=0, eig_top=0)
        ours = mon.fwd_hooks()
        hooks = {"before": [edit, *ours], "after": [*ours, edit], "plain": ours}[order]
        with torch.no_grad():
            bridge.run_with_hooks(ids, fwd_hooks=[*hooks, own])  # our own reader listed last of all
        a = torch.linalg.vector_norm(got["pre"] @ U, dim=-1) / torch.linalg.vector_norm(got["pre"], dim=-1)
        out[order] = (mon.summary().set_index("layer"), float(a.mean()))
    for order in ("before", "after", "plain"):
        df, ref = out[order]
        assert abs(df.loc[1, "gamma_pre"] - ref) < 1e-5 and abs(df.loc[0, "gamma_post"] - ref) < 1e-5, order
    assert abs(out["before"][1] - out["plain"][1]) > 1e-3  # the edit is real
    for c in COLS:
        assert (out["before"][0][c] - out["after"][0][c]).abs().max() < 1e-6, c


# ---- accelerate ----


@pytest.mark.parametrize("monitor_first", [True, False], ids=["edit-after", "edit-before"])
def test_accelerate_pre_forward_replacing_a_block_input(tiny, monitor_first):
    hooks = pytest.importorskip("accelerate.hooks")

    class Scale(hooks.ModelHook):
        """accelerate's own hook mechanism (it wraps module.forward, no torch hook)."""

        def pre_forward(self, module, *args, **kwargs):
            if args:
                return (args[0] * 3.0 + 1.0, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": kwargs["hidden_states"] * 3.0 + 1.0}

    block = _parts(tiny)[0][1][0]

    def edit():
        hooks.add_hook_to_module(block, Scale())
        return type("H", (), {"remove": lambda self: hooks.remove_hook_from_module(block)})()

    mon, ref, plain = _run(tiny, edit, monitor_first)
    _agree(mon, ref)
    assert abs(ref[1]["gamma_pre"] - plain[1]["gamma_pre"]) > 1e-3
