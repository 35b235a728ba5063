"""The monitor measures what the model computes: edits in any order, vanished hooks, whole forwards."""

from __future__ import annotations

import warnings

import pytest
import torch

import eigenhooks as eh

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
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    specs = eh.spectra(model)
    per = {s.layer: s.basis for s in specs}
    with eh.monitor(model, targets=[("ov", "modulus"), ("mine", per)]) as mon, torch.no_grad():
        model(**batch)
    df = mon.summary()
    a, b = df[df.target == "ov/modulus"].set_index("layer"), df[df.target == "mine"].set_index("layer")
    for c in ("gamma_pre", "gamma_mid", "rho", "null_rho_lo", "null_rho_hi", "p_null", "rho_ci_lo"):
        assert (a[c] - b[c]).abs().max() < 1e-9, c


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
    with eh.monitor(model, targets=[("ov", "modulus")], null_draws=400) as mon, torch.no_grad():
        model(**batch)
    h1.remove()
    h2.remove()
    row = mon.summary().set_index("layer").loc[layer]
    mask = batch["attention_mask"].bool()
    k = int(row["k"])
    g = torch.Generator().manual_seed(2024)
    rhos = []
    for _ in range(400):
        Q, _ = torch.linalg.qr(torch.randn(got["pre"].shape[-1], k, generator=g))
        a0, a1 = eh.metrics.alignment(got["pre"], Q), eh.metrics.alignment(got["mid"], Q)
        rhos.append(float(((a1 - a0) > 1e-6)[mask].float().mean()))
    rhos = np.array(rhos)
    # quantiles of two independent 400-draw Monte Carlos agree within their sampling error
    assert abs(np.quantile(rhos, 0.025) - row["null_rho_lo"]) < 0.06
    assert abs(np.quantile(rhos, 0.975) - row["null_rho_hi"]) < 0.06
    assert abs(np.mean(rhos < row["rho"]) - row["rho_percentile"]) < 0.06
    # cluster-robust CI from per-sequence counts
    U = eh.spectra(model)[layer].basis.float()
    up = (eh.metrics.alignment(got["mid"], U) - eh.metrics.alignment(got["pre"], U)) > 1e-6
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
    from conftest import build

    model = build("bert", dtype=torch.float32)
    ids = torch.randint(5, 64, (3, 9), generator=torch.Generator().manual_seed(0))
    with eh.monitor(model, targets=[("ov", "modulus")]) as mon, torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    df = mon.summary()
    assert df["rho_norm_only"].notna().all()
    assert df["rho_norm_only"].between(0, 1).all()
