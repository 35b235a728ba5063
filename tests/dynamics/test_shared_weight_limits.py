"""Shared-weight iteration: planted spectra reach the predicted limits; real models are measured."""

import math
import tracemalloc

import pytest
import torch
from typer.testing import CliRunner

import eigenhooks as eh
from eigenhooks.dynamics import trajectory as D
from eigenhooks.dynamics.planted import planted_albert, planted_gpt2, planted_matrix

D_MODEL = 16


@pytest.fixture(scope="module")
def x0():
    return torch.randn(1, 10, D_MODEL, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def test_planted_models_have_the_planted_spectrum():
    F = planted_matrix([2.0, 1.5 * complex(math.cos(0.6), math.sin(0.6))], D_MODEL, seed=1)
    for m in (planted_albert(F), planted_gpt2(F)):
        ad = eh.get_adapter(m)
        torch.testing.assert_close(ad.factors(0).matrix(), F, atol=1e-12, rtol=0)
        s = eh.spectra(m, cache=False)[0]
        assert abs(s.lambda_1 - 2.0) < 1e-12
        assert eh.verify(m)[0].max_abs_diff < 1e-10  # the model's own forward agrees


def test_real_dominant_reaches_consensus_along_v1(x0):
    m = planted_albert(planted_matrix([2.0], D_MODEL, seed=1))
    tr = D.iterate(m, x0, layer=0, steps=200, mode="paper")
    assert tr.alignment[-1] > 0.99 and tr.consensus[-1] > 0.99
    pred, meas = D.predict_limit(tr.spectrum), D.classify_limit(tr)
    assert pred.kind == meas.kind == "consensus" and D.agree(pred, meas)


@pytest.mark.parametrize("build", [planted_albert, planted_gpt2], ids=["albert", "gpt2-as-if-shared"])
def test_complex_dominant_rotates_at_the_predicted_angle(build, x0):
    lam = 1.5 * complex(math.cos(0.6), math.sin(0.6))
    m = build(planted_matrix([lam], D_MODEL, seed=1))
    tr = D.iterate(m, x0, layer=0, steps=200, mode="paper")
    assert tr.plane_alignment[-1] > 0.99
    C = tr.coords
    assert not torch.allclose(C[-1], C[-2], atol=1e-3)  # still rotating
    pred, meas = D.predict_limit(tr.spectrum), D.classify_limit(tr)
    assert pred.kind == meas.kind == "rotation"
    assert abs(pred.angle - math.atan2((1 + lam).imag, (1 + lam).real)) < 1e-9  # arg(1 + lambda_1)
    assert abs(meas.angle - pred.angle) < 0.05


def test_near_degenerate_converges_into_the_top_two_span(x0):
    m = planted_albert(planted_matrix([2.0, 1.997], D_MODEL, seed=1))  # |1+l2| / |1+l1| = 0.999
    tr = D.iterate(m, x0, layer=0, steps=500, mode="paper")
    assert tr.spectrum.kind == "near-degenerate" and abs(tr.spectrum.gap_ratio - 0.999) < 1e-9
    assert tr.plane_alignment[-1] > 0.99
    assert D.classify_limit(tr).kind == "near-degenerate"


def test_zoo_albert_model_mode_is_measured_and_reproducible():
    model, tok = eh.zoo.load("albert-tiny")
    inp = tok(["The for statement is used to iterate over a sequence"], return_tensors="pt")
    runs = [D.iterate(model, inp, layer=0, steps=500, mode="model") for _ in range(2)]
    # reproducible up to float rounding (multithreaded float32 kernels may reorder sums)
    for a, b in ((runs[0].alignment, runs[1].alignment), (runs[0].consensus, runs[1].consensus)):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-6
    pred, meas = D.predict_limit(runs[0].spectrum), D.classify_limit(runs[0])
    assert D.classify_limit(runs[1]).kind == meas.kind
    assert meas.kind in D.LIMITS and pred.kind in D.LIMITS
    # kept by pytest, shown with -rP or on a failure (not on every -q run)
    print(
        f"\n[zoo albert, model mode, 500 steps] lambda_1 {runs[0].spectrum.lambda_1:.4f} "
        f"({runs[0].spectrum.kind}); predicted {pred.kind}, measured {meas.kind}, "
        f"final alignment {meas.detail['alignment']:.4f}, consensus {meas.detail['consensus']:.4f}, "
        f"agree {D.agree(pred, meas)}"
    )


def test_bad_inputs(x0):
    m = planted_albert(planted_matrix([2.0], D_MODEL, seed=1))
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        D.iterate(m, x0, steps=0)
    with pytest.raises(IndexError, match="out of range"):
        D.iterate(m, x0, layer=7)
    with pytest.raises(ValueError, match=r"shape \(1, n, d=16\)"):
        D.iterate(m, torch.randn(1, 4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="mode must be"):
        D.iterate(m, x0, mode="ideal")


def test_long_run_memory_is_bounded(x0):
    m = planted_albert(planted_matrix([2.0], D_MODEL, seed=1))
    tracemalloc.start()
    tr = D.iterate(m, x0[:, :3], layer=0, steps=10_000, mode="paper", record_every=100)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(tr.steps) == 101 and peak < 20 * 2**20


def test_iterate_cli():
    from eigenhooks.cli import app

    r = CliRunner().invoke(app, ["iterate", "albert-tiny", "--steps", "50", "--mode", "paper"])
    assert r.exit_code == 0, r.output
    assert "predicted:" in r.output and "measured:" in r.output and "agree:" in r.output
