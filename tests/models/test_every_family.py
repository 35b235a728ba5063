"""Every architecture, on a seeded tiny model: F, verify, mid, padding, generate, steer.

The cases are in tests/cases/. Each check records its outcome in harness.RESULTS;
conftest writes docs/coverage.md from them when every case has run.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from cases import CASES
from harness import RESULTS, tap_values

import eigenhooks as eh
from eigenhooks.models.probe import probe_matrices

NAMES = sorted(CASES)


def _inputs(case, model, padded=False):
    return case.inputs(model, padded)


@pytest.mark.parametrize("name", NAMES)
def test_weights_equal_probe(name, built):
    case, model = CASES[name], built(name)
    ad = eh.get_adapter(model)
    assert ad.family == case.family, ad.family
    probed = probe_matrices(ad)
    worst = 0.0
    for i, ly in enumerate(ad.layers):
        if ly.factors is None:
            assert case.probe_only, f"layer {i} has no weight rule"
            continue
        F_w = ad.factors(i).matrix()
        scale = float(F_w.abs().max())
        assert scale > 1e-3, "F too small for the comparison to mean anything"
        rel = float((F_w - probed[i]).abs().max()) / scale
        if ly.linear:
            assert rel <= case.atol, (i, rel)
            worst = max(worst, rel)
        else:
            assert case.nonlinear, f"layer {i} is marked nonlinear"
    assert case.nonlinear == any(not ly.linear for ly in ad.layers)
    kind = "probe" if case.probe_only else "linearised" if case.nonlinear else "weights"
    RESULTS[(name, "F from weights")] = f"{kind} ({worst:.0e})" if kind != "probe" else kind


@pytest.mark.parametrize("name", NAMES)
def test_verify_is_never_nan(name, built):
    case, model = CASES[name], built(name)
    rows = eh.verify(model)
    assert rows and all(math.isfinite(r.max_abs_diff) and math.isfinite(r.linearity) for r in rows)
    for r in rows:
        if r.check == "weights" and r.linear:
            assert r.rel_diff <= case.atol, r
    assert all(r.linear for r in rows) == (not case.nonlinear), [(r.layer, r.linearity) for r in rows]
    checks = sorted({r.check for r in rows})
    RESULTS[(name, "verify")] = "/".join(checks) + ("" if not case.nonlinear else " (nonlinear flagged)")


@pytest.mark.parametrize("name", NAMES)
def test_mid_is_the_state_the_model_forms(name, built):
    case, model = CASES[name], built(name)
    ad = eh.get_adapter(model)
    inputs = _inputs(case, model)
    if case.mid is None:
        assert all(ad.reading_points(i).mid is None for i in range(ad.n_layers))
        RESULTS[(name, "mid")] = "pre+attn"
        return
    got = tap_values(ad, inputs, "mid")
    with torch.no_grad():
        ref = case.mid(model, inputs)
    assert sorted(ref) == list(range(ad.n_layers)), sorted(ref)
    for i in range(ad.n_layers):
        torch.testing.assert_close(got[i], ref[i], atol=1e-5, rtol=1e-5, msg=f"layer {i}")
    RESULTS[(name, "mid")] = "model state"


@pytest.mark.parametrize("name", NAMES)
def test_padded_batch_counts_real_tokens(name, built):
    case, model = CASES[name], built(name)
    inputs = _inputs(case, model, padded=True)
    mask = inputs.get("attention_mask")
    with eh.monitor(model, targets=[("ov", "modulus")], null_draws=16, fnull_draws=0, eig_top=0) as mon:
        with torch.no_grad():
            model(**inputs)
    df = mon.summary()
    stack_of = {ly.index: ly.stack for ly in mon.adapter.layers}
    for i, n in zip(df.index, df["n_tokens"]):
        expected = case.extra.get("tokens", {}).get(stack_of[i])
        if expected is None:
            expected = int(mask.sum()) if mask is not None else None
        if expected is not None:
            assert n == expected, (i, n, expected)
    assert df["rho"].notna().all()
    per_stack = "tokens" in case.extra
    RESULTS[(name, "padded")] = (
        "exact (per stack)" if per_stack else "exact" if mask is not None else "no mask (all tokens)"
    )


@pytest.mark.parametrize("name", NAMES)
def test_generate_counts_fed_tokens(name, built):
    case, model = CASES[name], built(name)
    if not case.generate:
        RESULTS[(name, "generate")] = "n/a (no LM head)"
        pytest.skip("not a generating model")
    if case.extra.get("generate") is not None:
        return _generate_per_stack(name, case, model)
    ids = _inputs(case, model)["input_ids"][:1]
    with eh.monitor(model, targets=[("ov", "modulus")], null_draws=16, fnull_draws=0, eig_top=0) as mon:
        with torch.no_grad():
            seq = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, min_new_tokens=4
            )
    df = mon.summary()
    fed = seq.shape[1] - 1  # the last token is never fed back
    assert (df["n_tokens"] == fed).all() and (df["n_sequences"] == 1).all(), df[["n_tokens", "n_sequences"]]
    RESULTS[(name, "generate")] = "exact"


@pytest.mark.parametrize("name", NAMES)
def test_steer_restores_weights(name, built):
    case, model = CASES[name], built(name)
    if not case.steer:
        RESULTS[(name, "steer")] = "n/a (no weight rule)"
        pytest.skip("no weight rule")
    ad = eh.get_adapter(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    u = torch.randn(ad.d_model, generator=g, dtype=torch.float64)
    inputs = _inputs(case, model)
    with torch.no_grad():
        plain = model(**inputs)
    cal = _calibration(case, model)
    with eh.steer(model, u / u.norm(), layer=-1, gap_ratio=0.1, calibration=cal, allow_shared=True) as s:
        with torch.no_grad():
            model(**inputs)
    assert abs(s.summary().cos_v1_u) > 0.999
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    with torch.no_grad():
        again = model(**inputs)
    first = lambda o: o[0] if isinstance(o, tuple) else next(iter(o.values()))  # noqa: E731
    assert torch.equal(first(plain), first(again))
    RESULTS[(name, "steer")] = "bit-exact restore"


def _generate_per_stack(name, case, model):
    """``Case.extra["generate"]``: model -> (generate kwargs, seq -> {stack: tokens each layer counts}).

    For encoder-decoders: the encoder runs once (outside the model's forward, in ``generate``), the
    decoder once per step; no MeasurementWarning may be raised, and every layer is one sequence.
    """
    kwargs, expect = case.extra["generate"](model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", eh.MeasurementWarning)
        with eh.monitor(model, targets=[("ov", "modulus")], null_draws=16, fnull_draws=0, eig_top=0) as mon:
            with torch.no_grad():
                seq = model.generate(**kwargs, do_sample=False)
    df = mon.summary()
    want, stack_of = expect(seq), {ly.index: ly.stack for ly in mon.adapter.layers}
    got = {int(i): (int(n), int(s)) for i, n, s in zip(df["layer"], df["n_tokens"], df["n_sequences"])}
    assert got == {i: (want[stack_of[i]], 1) for i in got}, (got, want)
    assert sorted(got) == list(range(mon.adapter.n_layers))
    RESULTS[(name, "generate")] = "exact (per stack)"


def _calibration(case, model):
    cal = case.extra.get("calibration")
    return cal(model) if cal is not None else None
