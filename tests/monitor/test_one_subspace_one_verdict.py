"""Benjamini-Hochberg over the table a reader sees (DESIGN, Statistics): one hypothesis per distinct
(layer, subspace) of the layer targets, equal subspaces sharing p and q, head targets their own
family, too few null tokens a NaN p and its own verdict; and the error rates that makes: about 5% of
rows at p < 0.05 on random targets, and under the global null a table-wide FDR <= 0.05."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import eigenhooks as eh
from eigenhooks.monitor import stats as M
from eigenhooks.monitor.measures import TGT_FIELDS
from eigenhooks.monitor.summary import HEADS, LAYERS, q_values

from .summaries import bh_by_hand


@pytest.fixture(scope="module")
def gpt2():
    return eh.zoo.load("gpt2-tiny")


def _ids(n_seq=2, n=100, seed=0):
    return torch.randint(0, 1000, (n_seq, n), generator=torch.Generator().manual_seed(seed))


def test_equal_subspaces_share_p_and_q(gpt2):
    """ov/modulus, ov/residual and the modulus basis given back as a custom target with its sign flipped:
    at each layer the equal subspaces get one p and one q, and q is BH over the distinct ones only."""
    model, _ = gpt2
    specs = eh.spectra(model, rank="modulus")
    flipped = {s.layer: -s.basis for s in specs}
    targets = [("ov", "modulus"), ("ov", "residual"), ("mine", flipped)]
    with eh.monitor(model, targets=targets, null_stride=1) as mon, torch.no_grad():
        model(input_ids=_ids(2, 100))
    df = mon.summary()
    assert (df["null_tokens"] >= M.MIN_NULL_TOKENS).all()
    distinct = []
    for layer, g in df.groupby("layer"):
        mod, mine = g[g.target == "ov/modulus"].iloc[0], g[g.target == "mine"].iloc[0]
        assert mod["p_null"] == mine["p_null"] and mod["q_null"] == mine["q_null"]  # seeded per layer: equal p
        assert mod["verdict"] == mine["verdict"]
        res = g[g.target == "ov/residual"].iloc[0]
        same = M.same_subspace(specs[layer].basis, eh.spectra(model, rank="residual")[layer].basis)
        if same:
            assert res["p_null"] == mod["p_null"] and res["q_null"] == mod["q_null"]
        distinct += [mod["p_null"]] + ([] if same else [res["p_null"]])
    assert len(distinct) < len(df)  # duplicates were counted once
    want = dict(zip(distinct, bh_by_hand(distinct)))
    np.testing.assert_allclose(df["q_null"], [want[p] for p in df["p_null"]], rtol=1e-12)


def test_q_values_families_and_nan():
    """Head rows are a family of their own; a NaN p stays out of BH; principal cosines decide equality."""
    d = 6
    e = torch.eye(d, dtype=torch.float64)
    U = [e[:, :1], e[:, :1].neg(), e[:, 1:2], e[:, :2], e[:, [1, 0]], e[:, :1]]
    nudged = e[:, :1] + 1e-5 * e[:, 2:3]
    U.append(nudged / nudged.norm())  # a principal cosine 1 - 5e-11 < 1 - 1e-12: another subspace
    layers = [0, 0, 0, 0, 0, 0, 0]
    fams = [LAYERS, LAYERS, LAYERS, LAYERS, LAYERS, HEADS, LAYERS]
    p = [0.01, 0.01, 0.02, 0.03, 0.03, 0.01, float("nan")]
    q = q_values(layers, U, fams, p)
    # layer family: {0, 1} one hypothesis, {2}, {3, 4} (k = 2, same plane), {6} NaN: three p's in BH
    assert q[0] == q[1] == pytest.approx(0.03) and q[2] == pytest.approx(0.03) and q[3] == q[4] == pytest.approx(0.03)
    assert q[5] == pytest.approx(0.01)  # alone in its family: the same U as row 0, but a head target
    assert math.isnan(q[6])
    assert not M.same_subspace(U[0], U[6]) and M.same_subspace(U[3], U[4]) and not M.same_subspace(U[0], U[3])


def test_too_few_tokens_says_so(gpt2):
    """The README's two-text example: 19 tokens, 5 of them the null's: p is NaN and the verdict says why."""
    model, tok = gpt2
    batch = tok(["def f(x):\n    return x", "class A:\n    pass"], return_tensors="pt", padding=True)
    with eh.monitor(model) as mon:
        model(**batch)
    df = mon.summary()
    assert (df["null_tokens"] < M.MIN_NULL_TOKENS).all()
    assert df["p_null"].isna().all() and df["q_null"].isna().all()
    assert (df["verdict_haar"] == "too few tokens").all()
    assert (df["verdict"] == "too few sequences").all() and (df["verdict_sequences"] < 10).all()
    assert df["rho"].notna().all() and df["null_rho_lo"].notna().all()  # the rest is still measured
    from eigenhooks.monitor.verdict import MIN_SEQUENCES
    from eigenhooks.run.table import rows

    heads, cells = rows(df)
    verdict = heads.index("verdict")
    assert all(c[verdict].startswith("too few sequences") and f"< {MIN_SEQUENCES}" in c[verdict] for c in cells)


def test_no_mid_reading_says_rho_needs_mid_not_too_few_tokens(gpt2):
    """reading_points=('pre', 'post') reads 400 tokens and no mid: the verdict says rho needs 'mid' (it said
    'too few tokens', null_tokens 0, as if the sample were small; issue 52). The same tokens with mid: verdicts."""
    model, _ = gpt2
    ids = _ids(4, 100)
    with eh.monitor(model, reading_points=("pre", "post")) as mon, torch.no_grad():
        model(input_ids=ids)
    df = mon.summary()
    assert (df["n_tokens"] == 400).all() and (df["verdict"] == M.NO_MID).all()
    from eigenhooks.run.report import _verdict_counts
    from eigenhooks.run.table import rows

    heads, cells = rows(df)
    assert all(c[heads.index("verdict")] == "no mid reading (Δγ needs 'mid')" for c in cells)
    assert 'class="chip v-no-mid-reading"' in _verdict_counts(df)
    with eh.monitor(model) as mon, torch.no_grad():
        model(input_ids=ids)
    assert not mon.summary()["verdict"].isin([M.NO_MID, M.TOO_FEW]).any()  # 4 sequences: "too few sequences"


def _random_targets(d, n, g):
    out = []
    for j in range(n):
        u = torch.randn(d, generator=g, dtype=torch.float64)
        out.append((f"rand{j}", u / u.norm()))
    return out


def test_random_targets_are_calibrated_row_and_table(gpt2):
    """Random targets have no special role: rho's Monte-Carlo p (p_rho_mc, the verdict's p before 2026-12)
    is < 0.05 for about 5% of rows, and under this global null (no effect anywhere) a table rejects
    anything, which is its false discovery rate, in at most 5% of tables, by BH over it and by the
    verdict's q_null (Δγ's fitted tail, p_null: at most 5% of rows at p < 0.05). Each table: 3 random
    targets x 4 layers, its own null seed and tokens, K = 999 draws (at K = 128 the floor 2/129 keeps BH
    over 12 rows of p_rho_mc from ever rejecting); 160 tables. BH per target (the old family) rejects in
    a table about 3 times as often."""
    model, _ = gpt2
    g = torch.Generator().manual_seed(7)
    tables, rows_hit, rows_n, per_target = 160, 0, 0, 0
    any_hit = tail_hit = tail_any = 0
    torch.set_num_threads(1)
    for r in range(tables):
        targets = _random_targets(model.config.n_embd, 3, g)
        with eh.monitor(
            model, targets=targets, null_seed=r, null_stride=1, null_draws=999, fnull_draws=0, eig_top=0
        ) as mon:
            with torch.no_grad():
                model(input_ids=_ids(2, 40, seed=1000 + r))
        df = mon.summary()
        assert df["p_null"].notna().all() and df["p_rho_mc"].notna().all()
        rows_hit += int((df["p_rho_mc"] < 0.05).sum())
        rows_n += len(df)
        any_hit += bool((np.asarray(M.bh(df["p_rho_mc"])) < 0.05).any())  # random targets: no equal subspaces
        per_target += any((np.asarray(M.bh(grp["p_rho_mc"])) < 0.05).any() for _, grp in df.groupby("target"))
        tail_hit += int((df["p_null"] < 0.05).sum())
        tail_any += bool((df["q_null"] < 0.05).any())
    share, fdr, old = rows_hit / rows_n, any_hit / tables, per_target / tables
    tail_share, tail_fdr = tail_hit / rows_n, tail_any / tables
    se_row, se_tab = math.sqrt(0.05 * 0.95 / rows_n), math.sqrt(0.05 * 0.95 / tables)
    print(
        f"\n[gpt2-tiny calibration] rows p<0.05: {share:.3f}; tables with a q<0.05: {fdr:.3f} (per-target BH: {old:.3f})"
        f"; the verdict's p (Δγ, t tail): rows p<0.05: {tail_share:.3f}, tables with a q_null<0.05: {tail_fdr:.3f}"
    )
    assert abs(share - 0.05) <= 3 * se_row + 0.01  # rows of one table share tokens and draws: a little slack
    assert fdr <= 0.05 + 2 * se_tab
    assert tail_share <= 0.05 + 3 * se_row + 0.01 and tail_fdr <= 0.05 + 2 * se_tab


def _tail_p_values(ts: np.ndarray, fit: np.ndarray, df: int) -> np.ndarray:
    """``M.tail_p_value`` of many statistics against one fit, at once (it takes one at a time: 336,780 calls
    took 41 s of this test); finite draws with a spread, as gpt2-tiny's are."""
    from scipy.stats import t as student

    sd = fit.std(ddof=1)
    assert np.isfinite(fit).all() and sd > 0
    z = np.abs(ts - fit.mean()) / (sd * math.sqrt(1 + 1 / fit.size))
    return np.minimum(1.0, 2 * student.sf(z, min(df, fit.size - 1)))


def test_tail_p_values_are_calibrated_in_the_far_tail(gpt2):
    """The verdict's p (Δγ against a t_8 fitted to the Haar draws) where BH reads it, at p ~ 0.05 / m: each of
    K = 1999 Haar draws is a random target (exchangeable with one), tested against a t fitted to 128 other
    draws (15 disjoint blocks, each tested on the draws outside it). The share at p < a stays at or below a
    (within its binomial error) for a = 0.001 .. 0.05, on the zoo's gpt2-tiny over 3 texts x 4 layers."""
    model, _ = gpt2
    levels = np.array([0.001, 0.002, 0.01, 0.05])
    hits, n = np.zeros(levels.size), 0
    for seed in range(3):
        with eh.monitor(model, null_seed=seed, null_stride=1, null_draws=1999, fnull_draws=0, eig_top=0) as mon:
            with torch.no_grad():
                model(input_ids=_ids(2, 100, seed=2000 + seed))
        for layer in mon._plan.layers:
            st = mon._acc.current(layer)
            t = dict(zip(TGT_FIELDS, st["tgt"][0].tolist()))
            dg = st["null_mid"][0].numpy() / t["n_sub"] - st["null_pre"][0].numpy() / t["n_pre_sub"]
            for b in range(0, 1999 - 128, 128):
                fit, test = dg[b : b + 128], np.concatenate([dg[:b], dg[b + 128 :]])
                p = _tail_p_values(test, fit, M.DGAMMA_TAIL_DF)
                some = test[:: len(test) // 16]  # the function itself, on 16 of them: the same p
                np.testing.assert_allclose(
                    p[:: len(test) // 16], [M.tail_p_value(x, fit, M.DGAMMA_TAIL_DF) for x in some], rtol=1e-12
                )
                hits += (p[:, None] < levels).sum(0)
                n += test.size
    share = hits / n
    print(f"\n[gpt2-tiny far tail] share p<a / a at a={levels.tolist()}: {np.round(share / levels, 2).tolist()}")
    assert (share <= levels + 3 * np.sqrt(levels / n) + 0.2 * levels).all()
