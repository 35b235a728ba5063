"""The monitor measures what the model computes: edits in any order, vanished hooks, whole forwards."""

from __future__ import annotations

import warnings

import pytest
import torch

import eigenhooks as eh
from eigenhooks.monitor import stats

TEXTS = ["def f(x):\n    return x * 2", "import os\nprint(os.getcwd())"]


@pytest.fixture(scope="module")
def gpt2():
    model, tok = eh.zoo.load("gpt2-tiny")
    tok.pad_token = tok.eos_token
    return model, tok


def _run(model, batch, register, before: bool):
    """Summary with an edit hook registered before or after the monitor enters."""
    handles = [register()] if before else []
    try:
        with eh.monitor(model, targets=[("ov", "modulus")]) as mon:
            if not before:
                handles.append(register())
            with torch.no_grad():
                model(**batch)
    finally:
        for h in handles:
            h.remove()
    return mon.summary().set_index("layer")


def _same(a, b, cols=("n_tokens", "gamma_pre", "gamma_mid", "gamma_post", "rho")):
    for c in cols:
        assert (a[c] - b[c]).abs().max() < 1e-6, c


def test_block_input_replaced_by_a_pre_hook_in_either_order(gpt2):
    model, tok = gpt2
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    blk = model.transformer.h[2]

    def register():
        return blk.register_forward_pre_hook(lambda m, a: (a[0] * 3.0 + 1.0, *a[1:]))

    a, b = _run(model, batch, register, True), _run(model, batch, register, False)
    _same(a, b)
    plain = _run(model, batch, lambda: blk.register_forward_pre_hook(lambda m, a: None), True)
    assert abs(a.loc[2, "gamma_pre"] - plain.loc[2, "gamma_pre"]) > 1e-4  # the edit is seen


def test_zeroed_attention_output_in_either_order(gpt2):
    model, tok = gpt2
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    attn = model.transformer.h[1].attn

    def register():
        return attn.register_forward_hook(lambda m, a, o: (torch.zeros_like(o[0]), *o[1:]))

    a, b = _run(model, batch, register, True), _run(model, batch, register, False)
    _same(a, b)
    assert a.loc[1, "rho"] == 0.0 and abs(a.loc[1, "gamma_mid"] - a.loc[1, "gamma_pre"]) < 1e-6


def test_hooks_cleared_behind_the_monitor_warn_and_stay_nan(gpt2):
    model, tok = gpt2
    batch = tok(TEXTS[:1], return_tensors="pt")
    with pytest.warns(eh.MeasurementWarning, match="removed by something else"):
        with eh.monitor(model) as mon:
            for m in model.modules():  # what pyvene does to every module
                m._forward_hooks.clear()
                m._forward_pre_hooks.clear()
            with torch.no_grad():
                model(**batch)
    df = mon.summary()
    assert (df["n_tokens"] == 0).all() and df["rho"].isna().all() and df["gamma_pre"].isna().all()


def test_a_forward_that_raises_counts_nothing(gpt2, tmp_path):
    model, tok = gpt2
    batch = tok(TEXTS[:1], return_tensors="pt")
    boom = model.transformer.h[3].register_forward_hook(lambda m, a, o: (_ for _ in ()).throw(RuntimeError("boom")))
    sink = tmp_path / "s.jsonl"
    with eh.monitor(model, sink=sink) as mon:
        with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
            model(**batch)
        boom.remove()
        with torch.no_grad():
            model(**batch)
    df = mon.summary()
    n = int(batch["attention_mask"].sum())
    assert (df["n_tokens"] == n).all(), "only the whole forward counts, in every layer"
    assert len(sink.read_text().splitlines()) == 1


def test_entering_a_monitor_twice_is_refused_and_leaves_no_hooks(gpt2):
    model, _ = gpt2
    count = lambda: sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    before = count()
    mon = eh.monitor(model)
    with mon:
        with pytest.raises(RuntimeError, match="already active"):
            mon.__enter__()
    assert count() == before


def test_no_forward_warns(gpt2):
    model, _ = gpt2
    with pytest.warns(eh.MeasurementWarning, match="no forward pass"):
        with eh.monitor(model):
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("error", eh.MeasurementWarning)
        with eh.monitor(model), torch.no_grad():
            model(input_ids=torch.tensor([[1, 2, 3]]))


def test_custom_target_errors(gpt2):
    model, _ = gpt2
    d = model.config.n_embd
    with pytest.raises(eh.TargetError, match="expected a unit vector"):
        eh.monitor(model, targets=[("p", torch.ones(d + 1))])
    with pytest.raises(eh.TargetError, match="not orthonormal"):
        eh.monitor(model, targets=[("p", torch.ones(d))])
    with pytest.raises(eh.TargetError, match="not orthonormal"):
        eh.monitor(model, targets=[("p", torch.ones(d, 2) / d**0.5)])
    with pytest.raises(eh.TargetError, match="layer key"):
        eh.monitor(model, targets=[("p", {99: torch.eye(d)[:, 0]})])


def test_custom_target_equals_builtin_on_the_same_basis(gpt2):
    model, tok = gpt2
    batch = tok([t * 6 for t in TEXTS], return_tensors="pt", padding=True)  # enough null tokens for a p_null
    specs = eh.spectra(model)
    per = {s.layer: s.basis for s in specs}
    with eh.monitor(model, targets=[("ov", "modulus"), ("mine", per)], null_stride=1) as mon, torch.no_grad():
        model(**batch)
    df = mon.summary()
    a, b = df[df.target == "ov/modulus"].set_index("layer"), df[df.target == "mine"].set_index("layer")
    for c in ("gamma_pre", "gamma_mid", "rho", "null_rho_lo", "null_rho_hi", "p_null", "rho_ci_lo"):
        assert (a[c] - b[c]).abs().max() < 1e-9, c
    assert a["p_null"].notna().all()


def test_null_quantiles_and_ci_match_an_independent_recomputation(gpt2):
    """Our own Monte Carlo from our own hooks, and a sequence-level cluster variance."""
    import numpy as np

    model, tok = gpt2
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    layer = 1
    blk = model.transformer.h[layer]
    got = {}
    h1 = blk.ln_1.register_forward_pre_hook(lambda m, a: got.__setitem__("pre", a[0].detach()))
    h2 = blk.ln_2.register_forward_pre_hook(lambda m, a: got.__setitem__("mid", a[0].detach()))
    # nulls on every token: these short texts leave 9 tokens at the default stride, too few for
    # two Monte Carlos' quantiles to agree within 0.06 (test_null_subsample checks the stride exactly)
    with eh.monitor(model, targets=[("ov", "modulus")], null_draws=400, null_stride=1) as mon, torch.no_grad():
        model(**batch)
    h1.remove()
    h2.remove()
    row = mon.summary().set_index("layer").loc[layer]
    mask = batch["attention_mask"].bool()
    sub = mask
    assert row["null_tokens"] == int(sub.sum())
    k = int(row["k"])
    g = torch.Generator().manual_seed(2024)
    rhos = []
    for _ in range(400):
        Q, _ = torch.linalg.qr(torch.randn(got["pre"].shape[-1], k, generator=g))
        a0, a1 = stats.alignment(got["pre"], Q), stats.alignment(got["mid"], Q)
        rhos.append(float(((a1 - a0) > 1e-6)[sub].float().mean()))
    rhos = np.array(rhos)
    # quantiles of two independent 400-draw Monte Carlos agree within their sampling error
    assert abs(np.quantile(rhos, 0.025) - row["null_rho_lo"]) < 0.06
    assert abs(np.quantile(rhos, 0.975) - row["null_rho_hi"]) < 0.06
    assert abs(np.mean(rhos < row["rho_null_tokens"]) - row["rho_percentile"]) < 0.06
    # cluster-robust CI from per-sequence counts
    U = eh.spectra(model)[layer].basis.float()
    up = (stats.alignment(got["mid"], U) - stats.alignment(got["pre"], U)) > 1e-6
    u = (up & mask).sum(1).double().numpy()
    n = mask.sum(1).double().numpy()
    rho = u.sum() / n.sum()
    C = len(u)
    se = np.sqrt(C / (C - 1) * np.sum((u - rho * n) ** 2) / n.sum() ** 2)
    assert abs(row["rho"] - rho) < 1e-9
    assert abs((row["rho_ci_hi"] - row["rho_ci_lo"]) - 2 * 1.959963984540054 * se) < 1e-6 or row["rho_ci_hi"] in (
        0.0,
        1.0,
    )


def test_post_norm_equal_normalisation_on_bert():
    from harness import build

    model = build("bert", dtype=torch.float32)
    ids = torch.randint(5, 64, (3, 9), generator=torch.Generator().manual_seed(0))
    with eh.monitor(model, targets=[("ov", "modulus")]) as mon, torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    df = mon.summary()
    assert df["rho_norm_only"].notna().all()
    assert df["rho_norm_only"].between(0, 1).all()


def _hook_count(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _measurement_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, eh.MeasurementWarning)]


def test_hooks_cleared_behind_the_monitor_give_exactly_one_warning(gpt2):
    model, tok = gpt2
    batch = tok(TEXTS[:1], return_tensors="pt")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with eh.monitor(model) as mon:
            for m in model.modules():
                m._forward_hooks.clear()
            with torch.no_grad():
                model(**batch)
    got = _measurement_warnings(rec)
    assert len(got) == 1 and "removed by something else" in got[0], got
    df = mon.summary()
    assert (df["n_tokens"] == 0).all() and df[["gamma_pre", "gamma_mid", "rho", "p_null"]].isna().all().all()


def test_pyvene_inside_a_monitor_warns_once_and_stays_nan(gpt2):
    pv = pytest.importorskip("pyvene")
    model, tok = gpt2
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with eh.monitor(model, targets=[("ov", "modulus")]) as mon:
            cfg = pv.IntervenableConfig(
                [{"layer": 1, "component": "block_output", "intervention_type": pv.ZeroIntervention}]
            )
            pvm = pv.IntervenableModel(cfg, model)
            with torch.no_grad():
                _, out = pvm({"input_ids": batch["input_ids"]}, unit_locations={"base": 2})
    assert out is not None  # pyvene really ran its intervened forward
    got = _measurement_warnings(rec)
    assert len(got) == 1 and "pyvene" in got[0] and "inside the other tool's context" in got[0], got
    df = mon.summary()
    assert (df["n_tokens"] == 0).all(), "never a silent count of what pyvene's forward did not show us"
    assert df[["gamma_pre", "gamma_mid", "gamma_post", "rho"]].isna().all().all(), "NaN, never 0"


def test_no_graph_breaks_from_the_monitor_under_torch_compile():
    """fullgraph=True raises at the first graph break: the hooks compile into the model's graph,
    and the compiled forward measures exactly what the eager one does."""
    from harness import build

    model = build("gpt2", dtype=torch.float32)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with eh.monitor(model, targets=[("ov", "modulus")], null_draws=16) as eager, torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    torch._dynamo.reset()
    try:
        with eh.monitor(model, targets=[("ov", "modulus")], null_draws=16) as mon, torch.no_grad():
            torch.compile(model, fullgraph=True, backend="eager")(input_ids=ids, attention_mask=mask)
    finally:
        torch._dynamo.reset()
    a, b = eager.summary(), mon.summary()
    assert (b["n_tokens"] == int(mask.sum())).all()
    for c in ("gamma_pre", "gamma_mid", "gamma_post", "rho", "null_rho_lo", "null_rho_hi", "consensus_pre"):
        assert (a[c] - b[c]).abs().max() < 1e-6, c


def test_model_compiled_before_the_monitor_warns_what_to_do():
    from harness import build

    model = build("gpt2", dtype=torch.float32)
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    try:
        with torch.no_grad():
            compiled(input_ids=ids)  # compiled without hooks
            with pytest.warns(eh.MeasurementWarning, match=r"torch\.compile.*torch\._dynamo\.reset\(\)"):
                with eh.monitor(model, targets=[("ov", "modulus")]) as stale:
                    compiled(input_ids=ids)
            assert stale.summary()["rho"].isna().all() and (stale.summary()["n_tokens"] == 0).all()
            with warnings.catch_warnings():
                warnings.simplefilter("error", eh.MeasurementWarning)
                with eh.monitor(model, targets=[("ov", "modulus")]) as fixed:
                    torch._dynamo.reset()  # the advice: recompile with the hooks in place
                    compiled(input_ids=ids)
            assert (fixed.summary()["n_tokens"] == 6).all()
    finally:
        torch._dynamo.reset()


def test_a_forward_raising_at_layer_1_commits_nothing_and_the_sink_agrees(gpt2, tmp_path):
    import json

    model, tok = gpt2
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    state = {"raise": True}

    def boom(m, a, o):
        if state["raise"]:
            raise RuntimeError("boom at layer 1")

    h = model.transformer.h[1].register_forward_hook(boom)
    sink = tmp_path / "stats.jsonl"
    try:
        with eh.monitor(model, targets=[("ov", "modulus")], sink=sink) as mon:
            with pytest.raises(RuntimeError, match="boom at layer 1"), torch.no_grad():
                model(**batch)
            assert mon.stats[(0, "ov/modulus")]["n"] == 0, "layer 0 ran whole, but its forward did not"
            state["raise"] = False
            with torch.no_grad():
                model(**batch)
    finally:
        h.remove()
    lines = [json.loads(x) for x in sink.read_text().splitlines()]
    assert len(lines) == 1
    for row in lines[0]["stats"]:
        st = mon.stats[(row["layer"], row["target"])]
        for k in ("n", "n_up", "sum_pre", "sum_mid", "sum_post"):
            assert abs(row[k] - st[k]) < 1e-9, (row["layer"], k)
    assert {r["layer"] for r in lines[0]["stats"]} == set(range(model.config.n_layer))


def test_a_keyboard_interrupt_mid_forward_counts_nothing_and_leaves_no_hooks(gpt2):
    model, tok = gpt2
    batch = tok(TEXTS[:1], return_tensors="pt")
    before = _hook_count(model)
    h = model.transformer.h[2].register_forward_hook(lambda m, a, o: (_ for _ in ()).throw(KeyboardInterrupt))
    with eh.monitor(model, targets=[("ov", "modulus")]) as mon:
        with pytest.raises(KeyboardInterrupt), torch.no_grad():
            model(**batch)  # torch's always_call hooks do not run for a KeyboardInterrupt
        h.remove()
    assert _hook_count(model) == before
    assert (mon.summary()["n_tokens"] == 0).all()


def test_closed_during_a_forward_it_detaches_when_that_forward_ends(gpt2):
    """As when entered inside nnsight's trace: the with-block ends while the forward runs."""
    model, tok = gpt2
    batch = tok(TEXTS[:1], return_tensors="pt")
    n = int(batch["attention_mask"].sum())
    before = _hook_count(model)
    for raise_after in (False, True):
        mon = eh.monitor(model, targets=[("ov", "modulus")])
        mon.__enter__()
        h0 = model.transformer.h[0].register_forward_hook(lambda m, a, o: mon.__exit__(None, None, None))
        h1 = model.transformer.h[1].register_forward_hook(
            lambda m, a, o: (_ for _ in ()).throw(RuntimeError("late")) if raise_after else None
        )
        try:
            if raise_after:
                with pytest.raises(RuntimeError, match="late"), torch.no_grad():
                    model(**batch)
            else:
                with torch.no_grad():
                    model(**batch)
        finally:
            h0.remove()
            h1.remove()
        if raise_after:
            assert (mon.summary()["n_tokens"] == 0).all()
            with torch.no_grad():
                model(**batch)  # the two inert model-level hooks come off at the next call
            assert (mon.summary()["n_tokens"] == 0).all(), "nothing after the close counts"
        else:
            assert (mon.summary()["n_tokens"] == n).all(), "the forward the close waited for counts whole"
        assert _hook_count(model) == before


# ---- TransformerLens 4 bridge: padding never counts ----

UNEQUAL = ["def f(x):\n    return x * 2", "import os", "a = 1\nb = 2\nprint(a + b)"]


@pytest.fixture(scope="module")
def bridge(gpt2):
    tl = pytest.importorskip("transformer_lens")
    model, tok = gpt2
    return tl.TransformerBridge.boot_transformers("gpt2", hf_model=model, tokenizer=tok, dtype=torch.float32)


def _real_tokens(tok, side: str) -> int:
    mask = tok(UNEQUAL, padding=True, padding_side=side, return_tensors="pt")["attention_mask"]
    assert int(mask.sum()) < mask.numel(), "the batch must really be padded"
    return int(mask.sum())


@pytest.mark.parametrize("side", ["right", "left"])
def test_lens_strings_count_only_real_tokens(bridge, gpt2, side):
    n = _real_tokens(gpt2[1], side)
    assert n == sum(bridge.to_tokens(t).shape[1] for t in UNEQUAL)  # one by one: nothing to pad
    with eh.monitor(bridge, targets=[("ov", "modulus")], null_draws=8) as mon, torch.no_grad():
        bridge(UNEQUAL, padding_side=side)
    assert (mon.summary()["n_tokens"] == n).all()
    hooked = eh.monitor(bridge, targets=[("ov", "modulus")], null_draws=8, attach=False)
    with torch.no_grad():
        bridge.run_with_hooks(UNEQUAL, fwd_hooks=hooked.fwd_hooks(), padding_side=side)
    assert (hooked.summary()["n_tokens"] == n).all()


def test_lens_run_with_hooks_attention_mask_counts_only_real_tokens(bridge, gpt2):
    tok = gpt2[1]
    enc = tok(UNEQUAL, padding=True, padding_side="left", return_tensors="pt")
    n = int(enc["attention_mask"].sum())
    args = dict(fwd_hooks=[], attention_mask=enc["attention_mask"])
    with eh.monitor(bridge, targets=[("ov", "modulus")], null_draws=8) as attached, torch.no_grad():
        bridge.run_with_hooks(enc["input_ids"], **args)
    hooked = eh.monitor(bridge, targets=[("ov", "modulus")], null_draws=8, attach=False)
    with torch.no_grad():
        bridge.run_with_hooks(enc["input_ids"], **{**args, "fwd_hooks": hooked.fwd_hooks()})
    for mon in (attached, hooked):
        assert (mon.summary()["n_tokens"] == n).all()
    a, b = attached.summary(), hooked.summary()
    assert (a["gamma_pre"] - b["gamma_pre"]).abs().max() < 1e-6 and (a["rho"] - b["rho"]).abs().max() < 1e-9


class _Skip(torch.nn.Module):
    """An attention swapped in by another tool: returns zeros, carries none of our hooks."""

    def forward(self, hidden_states, *args, **kwargs):
        return torch.zeros_like(hidden_states), None


@pytest.mark.parametrize("swap", ["attn", "ln_2"])
def test_a_swapped_sublayer_warns_and_reads_nan_never_0(gpt2, swap):
    import copy

    model, tok = gpt2
    batch = tok(TEXTS[:1], return_tensors="pt")
    blk = model.transformer.h[1]
    old = getattr(blk, swap)
    with pytest.warns(eh.MeasurementWarning, match=r"in layers \[1\] the attention or the next sublayer was not seen"):
        with eh.monitor(model, targets=[("ov", "modulus")]) as mon:
            new = _Skip() if swap == "attn" else copy.deepcopy(old)
            new._forward_pre_hooks.clear()  # a fresh module, as a swapped HookPoint is
            new._forward_hooks.clear()
            setattr(blk, swap, new)
            try:
                with torch.no_grad():
                    model(**batch)
            finally:
                setattr(blk, swap, old)
    df = mon.summary().set_index("layer")
    assert df.loc[1, ["gamma_mid", "rho", "p_null"]].isna().all(), "no attention step seen: NaN, not 0"
    assert df.drop(index=1)["rho"].notna().all() and (df["n_tokens"] == int(batch["attention_mask"].sum())).all()


def test_lens_forward_raising_mid_way_counts_nothing(bridge, gpt2):
    ids = gpt2[1](UNEQUAL[:1], return_tensors="pt")["input_ids"]

    def boom(act, hook):
        raise RuntimeError("boom in block 2")

    hooked = eh.monitor(bridge, targets=[("ov", "modulus")], null_draws=8, attach=False)
    with pytest.raises(RuntimeError, match="boom in block 2"), torch.no_grad():
        bridge.run_with_hooks(ids, fwd_hooks=[*hooked.fwd_hooks(), ("blocks.2.hook_resid_pre", boom)])
    with eh.monitor(bridge, targets=[("ov", "modulus")], null_draws=8) as attached:
        with pytest.raises(RuntimeError, match="boom in block 2"), torch.no_grad():
            bridge.run_with_hooks(ids, fwd_hooks=[("blocks.2.hook_resid_pre", boom)])
    for mon in (hooked, attached):
        assert (mon.summary()["n_tokens"] == 0).all()
    with torch.no_grad():
        bridge.run_with_hooks(ids, fwd_hooks=hooked.fwd_hooks())
    assert (hooked.summary()["n_tokens"] == ids.shape[1]).all(), "the next whole forward counts, alone"
