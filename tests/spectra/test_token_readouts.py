"""Token readouts with a null (eh.read_tokens) and your own directions ranked (eh.rank_directions), against numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import eigenhooks as eh

from .test_head_and_group_spectra import _llama


@pytest.fixture(scope="module")
def gpt2():
    return eh.zoo.load("gpt2-tiny")


def _rows(model, side):
    """Unit rows from the raw weights: GPT-2's lm_head times ln_f's scale (out), or wte (in)."""
    if side == "out":
        W = model.lm_head.weight.detach().double().numpy() * model.transformer.ln_f.weight.detach().double().numpy()
    else:
        W = model.transformer.wte.weight.detach().double().numpy()
    return W / np.linalg.norm(W, axis=1, keepdims=True)


@pytest.mark.parametrize("side", ["out", "in"])
def test_direction_readout_against_numpy_cosines(gpt2, side):
    model, tok = gpt2
    d = model.config.n_embd
    u = np.random.default_rng(0).standard_normal(d)
    r = eh.read_tokens(model, tok, torch.from_numpy(u), k=5, side=side, null_draws=50)
    cos = _rows(model, side) @ (u / np.linalg.norm(u))
    hi, lo = np.argsort(-cos)[:5], np.argsort(cos)[:5]
    assert [t for t, _ in r.top] == [tok.decode([int(i)]) for i in hi]
    assert [t for t, _ in r.bottom] == [tok.decode([int(i)]) for i in lo]
    np.testing.assert_allclose([s for _, s in r.top], cos[hi], atol=1e-12)
    np.testing.assert_allclose([s for _, s in r.bottom], cos[lo], atol=1e-12)
    assert r.score == pytest.approx(max(cos[hi].mean(), -cos[lo].mean()), abs=1e-12)
    assert r.kind == "direction" and r.null_lo <= r.null_hi
    flipped = eh.read_tokens(model, tok, torch.from_numpy(-u), k=5, side=side, null_draws=50)
    assert flipped.score == pytest.approx(r.score, abs=1e-12)  # an eigenvector's sign is arbitrary


def test_plane_readout_against_numpy(gpt2):
    model, tok = gpt2
    d = model.config.n_embd
    rng = np.random.default_rng(1)
    v = rng.standard_normal(d) + 1j * rng.standard_normal(d)
    r = eh.read_tokens(model, tok, torch.from_numpy(v), k=7, null_draws=50)
    Q = np.linalg.qr(np.stack([v.real, v.imag], 1))[0]
    p = np.linalg.norm(_rows(model, "out") @ Q, axis=1)
    hi = np.argsort(-p)[:7]
    assert r.kind == "plane" and r.bottom == []
    assert [t for t, _ in r.top] == [tok.decode([int(i)]) for i in hi]
    np.testing.assert_allclose([s for _, s in r.top], p[hi], atol=1e-12)
    assert r.score == pytest.approx(p[hi].mean(), abs=1e-12)
    same = eh.read_tokens(model, tok, torch.from_numpy(np.stack([v.real, v.imag], 1)), k=7, null_draws=50)
    assert same.top == r.top  # a complex vector reads as the plane of its two real columns


@pytest.mark.parametrize("plane", [False, True])
def test_null_band_is_that_of_haar_directions(gpt2, plane):
    model, tok = gpt2
    W = _rows(model, "out")
    d, k, n = W.shape[1], 10, 400
    rng = np.random.default_rng(7)  # another generator than the library's
    stats = []
    for _ in range(n):
        Q = np.linalg.qr(rng.standard_normal((d, 2 if plane else 1)))[0]
        P = W @ Q
        if plane:
            stats.append(np.sort(np.linalg.norm(P, axis=1))[-k:].mean())
        else:
            c = np.sort(P[:, 0])
            stats.append(max(c[-k:].mean(), -c[:k].mean()))
    lo, hi = np.quantile(stats, [0.025, 0.975])
    u = torch.randn(d, 2 if plane else 1, dtype=torch.float64)
    r = eh.read_tokens(model, tok, u if plane else u[:, 0], k=k, null_draws=n, seed=3)
    width = hi - lo
    assert abs(r.null_lo - lo) < 0.3 * width and abs(r.null_hi - hi) < 0.3 * width, (r.null_lo, r.null_hi, lo, hi)
    # a token's own row is far more token-like than any random direction
    t = int(np.argmax(np.linalg.norm(W, axis=1)))
    own = eh.read_tokens(model, tok, torch.from_numpy(W[t]), k=1, null_draws=100)
    assert own.top[0] == (tok.decode([t]), pytest.approx(1.0)) and own.score > own.null_hi


def test_readout_of_a_spectrum_and_its_errors(gpt2):
    model, tok = gpt2
    s = eh.spectra(model)[0]
    r = eh.read_tokens(model, tok, s, k=3, null_draws=20)
    assert r.kind == ("plane" if s.k == 2 else "direction")
    with pytest.raises(ValueError, match="side must be one of"):
        eh.read_tokens(model, tok, s, side="up")
    with pytest.raises(ValueError, match="k must be a positive int"):
        eh.read_tokens(model, tok, s, k=0)
    with pytest.raises(ValueError, match="u is zero"):
        eh.read_tokens(model, tok, torch.zeros(model.config.n_embd))
    with pytest.raises(ValueError, match="u is two parallel columns"):
        eh.read_tokens(model, tok, torch.ones(model.config.n_embd, 2))
    with pytest.raises(ValueError, match=r"expected a \(d=.*\) direction"):
        eh.read_tokens(model, tok, torch.ones(3))
    with pytest.raises(ValueError, match="load the model with its LM head"):
        eh.read_tokens(model.transformer, tok, s)


def test_rank_directions_against_numpy():
    model = _llama()
    specs = eh.spectra(model, heads=True, cache=False)
    rng = np.random.default_rng(0)
    X = rng.standard_normal((6, 16))
    X[2] = 3 * specs[1].basis[:, 0].numpy()  # lies in layer 1's principal subspace
    df = eh.rank_directions(specs, X, null_draws=20000, seed=1)
    assert len(df) == 2 * (1 + 4 + 2) * 6
    Xn = X / np.linalg.norm(X, axis=1, keepdims=True)
    for (layer, part, index), g in df.groupby(["layer", "part", "index"]):
        s = specs[layer]
        U = {"layer": s.basis, "head": s.heads[index].basis if part == "head" else None}.get(part)
        U = (s.groups[index].basis if part == "group" else U).numpy()
        a = np.linalg.norm(Xn @ U, axis=1)
        np.testing.assert_allclose(g.sort_values("direction")["alignment"].to_numpy(), a, atol=1e-12)
        assert g.sort_values("direction")["rank"].tolist() == (np.argsort(np.argsort(-a, kind="stable")) + 1).tolist()
        from scipy.stats import beta

        k = U.shape[1]
        ref = np.sqrt(beta.ppf([0.025, 0.975], k / 2, (16 - k) / 2))  # ‖Uᵀx̂‖² ~ Beta(k/2, (d-k)/2)
        np.testing.assert_allclose(g[["null_lo", "null_hi"]].iloc[0].to_numpy(dtype=float), ref, atol=0.01)
    top = df[(df.layer == 1) & (df.part == "layer") & (df.direction == 2)].iloc[0]
    assert top.alignment == pytest.approx(1.0) and top["rank"] == 1 and top.above_null
    with pytest.raises(ValueError, match=r"directions must be \(n, d=16\)"):
        eh.rank_directions(specs, np.ones((2, 5)))
    with pytest.raises(ValueError, match=r"directions \[0\] \(of 1\) are zero or hold NaN or inf"):
        eh.rank_directions(specs, np.zeros((1, 16)))


def test_run_report_says_what_the_direction_is(gpt2, tmp_path):
    """The run writes directions.json; its v_1 readouts are read_tokens' on the run's spectra, and the
    report shows them with the null band and a per-head table."""
    import json

    from eigenhooks.run import run

    res = run("gpt2-tiny", max_tokens=100, batch_size=4, out=tmp_path / "r", progress=False)
    assert res.status == "complete"
    doc = json.loads((tmp_path / "r" / "directions.json").read_text())
    model, tok = gpt2
    specs = eh.spectra(model, heads=True)
    assert [r["layer"] for r in doc["layers"]] == [s.layer for s in specs]
    ref = eh.read_tokens(model, tok, specs[2], k=10, null_draws=100)  # the run reads with 100 draws
    got = doc["layers"][2]
    assert [t for t, _ in got["top"]] == [t for t, _ in ref.top]
    assert got["score"] == pytest.approx(ref.score) and got["null_hi"] == pytest.approx(ref.null_hi)
    assert len(doc["parts"]) == 4 * (4 + 4)  # 4 layers x (4 heads + 4 groups)
    for rec, s in zip(doc["layers"], specs):  # the spectral kind, not the readout's direction/plane (issue 52)
        assert (rec["kind"], rec["k"]) == (s.kind, s.k)
        assert rec["reads_as"] == ("direction" if s.k == 1 else "plane")
    page = (tmp_path / "r" / "report.html").read_text()
    assert "What the direction is" in page and "Per head and key/value group" in page
    assert f"{ref.null_lo:.3f}–{ref.null_hi:.3f}" in page and "q (BH over " in page
    meta = json.loads((tmp_path / "r" / "meta.json").read_text())
    assert "directions.json" in meta["files"]  # stamped: `eigenhooks report` checks it like the others


@pytest.mark.parametrize(
    "u, match",
    [
        ("nan", r"u has 128 of 128 entries NaN or inf \(the first at 0, nan\); pass a finite direction"),
        ("inf", r"u has 1 of 128 entries NaN or inf \(the first at 7, inf\); pass a finite direction"),
        (None, r"u: expected a \(d=128,\) direction, .* got NoneType None"),
        ("a string", r"u: expected a \(d=128,\) direction, .* got str 'a string'"),
    ],
)
def test_read_tokens_says_what_is_wrong_with_u(gpt2, u, match):
    """One line naming what came and what to pass, never a shape it was not given or a raw TypeError (issue 52)."""
    model, tok = gpt2
    if u in ("nan", "inf"):
        v = torch.randn(128)
        v[7 if u == "inf" else slice(None)] = float(u)
        u = v
    with pytest.raises(ValueError, match=match):
        eh.read_tokens(model, tok, u, null_draws=5)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(null_draws="x"), r"null_draws must be an int >= 0 \(0: no null band\), got 'x'"),
        (dict(null_draws=2.5), r"null_draws must be an int >= 0 .*got 2.5"),
        (dict(null_draws=-1), r"null_draws must be an int >= 0 .*got -1"),
        (dict(seed="x"), r"seed must be an int \(the null's seed\), got 'x'"),
        (dict(k=True), r"k must be a positive int, got True"),
    ],
)
def test_read_tokens_names_a_bad_argument(gpt2, kw, match):
    model, tok = gpt2
    with pytest.raises(ValueError, match=match):
        eh.read_tokens(model, tok, torch.randn(128), **{"null_draws": 5, **kw})
    assert eh.read_tokens(model, tok, torch.randn(128), null_draws=np.int64(3), seed=np.int64(1)).null_draws == 3


@pytest.mark.parametrize("theta", [np.pi / 2, 2.0, -0.7, np.pi])
def test_a_real_direction_turned_by_a_phase_is_that_direction(gpt2, theta):
    """u e^{i theta}: Re and Im parallel, so one direction (k = 1, the phase dropped), as monitor targets read it."""
    model, tok = gpt2
    u = torch.randn(128, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    turned = eh.read_tokens(model, tok, u * complex(np.cos(theta), np.sin(theta)), k=5, null_draws=20)
    real = eh.read_tokens(model, tok, u, k=5, null_draws=20)
    assert turned.kind == "direction"
    # the sign is that of the larger part (the monitor's rule): +u unless the larger part is -u
    larger = np.cos(theta) if abs(np.cos(theta)) >= abs(np.sin(theta)) else np.sin(theta)
    want = real if larger > 0 else eh.read_tokens(model, tok, -u, k=5, null_draws=20)
    assert [t for t, _ in turned.top] == [t for t, _ in want.top]
    np.testing.assert_allclose([s for _, s in turned.top], [s for _, s in want.top], atol=1e-12)
    assert turned.score == pytest.approx(real.score, abs=1e-12)
    assert (turned.null_lo, turned.null_hi) == (real.null_lo, real.null_hi)
    # a real complex eigenvector is still a plane
    assert eh.read_tokens(model, tok, u + 1j * torch.randn(128, dtype=torch.float64), null_draws=5).kind == "plane"


def test_rank_directions_says_what_is_wrong():
    model = _llama()
    specs = eh.spectra(model, heads=True, cache=False)
    X = np.random.default_rng(0).standard_normal((3, 16))
    Xi = X.copy()
    Xi[1, 4] = np.inf
    with pytest.raises(ValueError, match=r"directions \[1\] \(of 3\) are zero or hold NaN or inf"):
        eh.rank_directions(specs, Xi)
    for bad in (None, "abc"):
        with pytest.raises(ValueError, match=r"specs: expected eh.spectra\(model, ...\), a list of LayerSpectrum"):
            eh.rank_directions(bad, X)
        with pytest.raises(ValueError, match=r"directions: expected an \(n, d=16\) array or tensor of rows"):
            eh.rank_directions(specs, bad)
    with pytest.raises(ValueError, match=r"specs\[1\] is a str, not a LayerSpectrum"):
        eh.rank_directions([specs[0], "x"], X)
    with pytest.raises(ValueError, match=r"directions\[0\] is complex .* a plane, not a direction"):
        eh.rank_directions(specs, X + 1j * np.random.default_rng(1).standard_normal((3, 16)))
    # one spectrum is a list of one; a phase-turned real row is that row
    one = eh.rank_directions(specs[1], X, null_draws=50)
    assert one.equals(eh.rank_directions([specs[1]], X, null_draws=50))
    turned = eh.rank_directions(specs, X * np.exp(0.4j), null_draws=50)
    np.testing.assert_allclose(turned.alignment, eh.rank_directions(specs, X, null_draws=50).alignment, atol=1e-12)
