"""The null's token subsample: the target is compared with the draws on the same tokens."""

import numpy as np
import pytest
import scipy.stats
import torch

import eigenhooks as eh
from eigenhooks.monitor.stats import alignment, mc_p_value


@pytest.fixture(scope="module")
def gpt2():
    return eh.zoo.load("gpt2-tiny")


def _batch(tok, rows=8):
    texts = [f"def f{i}(x):\n    return x * {i} + {i * i} - len(str(x))" for i in range(rows)]
    return tok(texts, return_tensors="pt", padding=True)


def _readings(model, batch, layer):
    blk = model.transformer.h[layer]
    got = {}
    h1 = blk.ln_1.register_forward_pre_hook(lambda m, a: got.__setitem__("pre", a[0].detach()))
    h2 = blk.ln_2.register_forward_pre_hook(lambda m, a: got.__setitem__("mid", a[0].detach()))
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        h1.remove()
        h2.remove()
    return got["pre"], got["mid"]


def test_null_subsample_compares_target_and_draws_on_the_same_tokens(gpt2):
    model, tok = gpt2
    batch = _batch(tok)
    b, n = batch["input_ids"].shape
    layer, stride = 1, 3
    with eh.monitor(model, targets=[("ov", "modulus")], null_stride=stride) as mon, torch.no_grad():
        model(**batch)
    row = mon.summary().set_index("layer").loc[layer]
    pre, mid = _readings(model, batch, layer)
    assert b * n > 2 * stride, "the test must exercise the subsample"
    sel = torch.zeros(b * n, dtype=torch.bool)
    sel[::stride] = True
    sel = sel.view(b, n) & batch["attention_mask"].bool()
    U = eh.spectra(model)[layer].basis.float()
    up = (alignment(mid, U) - alignment(pre, U)) > 1e-6
    assert row["null_tokens"] == int(sel.sum())
    assert abs(row["rho_null_tokens"] - float(up[sel].double().mean())) < 1e-9
    assert abs(row["rho"] - float(up[batch["attention_mask"].bool()].double().mean())) < 1e-9
    # the draws, from the reducer's own frames, on the same tokens: the same quantiles and p
    red = mon._plan.layers[layer].bases
    H = red.Bn64[:, slice(*red.cols["haar"])].float()
    draws, dgs = [], []
    for j in range(red.frames["haar"].shape[0]):
        Q = H[:, j * red.frame_width : j * red.frame_width + int(row["k"])]
        u = (alignment(mid, Q) - alignment(pre, Q)) > 1e-6
        draws.append(float(u[sel].double().mean()))
        dgs.append(float((alignment(mid, Q) - alignment(pre, Q))[sel].double().mean()))
    draws, dgs = np.array(draws), np.array(dgs)
    # the verdict's test, written out: Δγ on the same tokens against a t_8 fitted to the draws' Δγ
    dg = float((alignment(mid, U) - alignment(pre, U))[sel].double().mean())
    assert abs(row["dgamma"] - dg) < 1e-6 and abs(row["null_dgamma_mean"] - dgs.mean()) < 1e-6
    z = abs(dg - dgs.mean()) / (dgs.std(ddof=1) * np.sqrt(1 + 1 / dgs.size))
    assert row["p_null"] == pytest.approx(2 * scipy.stats.t.sf(z, 8), rel=1e-3)
    assert abs(draws.mean() - row["null_rho_mean"]) < 1e-9
    assert abs(np.quantile(draws, 0.025) - row["null_rho_lo"]) < 1e-9
    p = row["p_rho_mc"]
    lo, hi = mc_p_value(row["rho_null_tokens"], draws, None), _p_without_ties(row["rho_null_tokens"], draws)
    assert hi - 1e-12 <= p <= lo + 1e-12  # ties broken at random: between the two tie conventions


def _p_without_ties(t, x):
    below, above = np.sum(x < t), np.sum(x > t)
    return min(1.0, 2 * min(1 + below, 1 + above) / (x.size + 1))


def test_random_tie_breaking_gives_exact_size():
    """Under the null (t exchangeable with the draws, heavy ties), P(p <= alpha) = alpha with ties broken."""
    g = np.random.default_rng(0)
    K, alpha = 19, 0.1  # 2 r / 20 <= 0.1 for r = 1 and r = 20: exact size 0.1
    hits = {None: 0, "seeded": 0}
    n = 4000
    for i in range(n):
        v = g.integers(0, 4, K + 1) / 4  # few distinct values: many ties
        t, x = v[0], v[1:]
        hits[None] += mc_p_value(t, x) <= alpha
        hits["seeded"] += mc_p_value(t, x, tie_seed=i) <= alpha
    se = np.sqrt(alpha * (1 - alpha) / n)
    assert abs(hits["seeded"] / n - alpha) < 4 * se
    assert hits[None] / n < alpha - 4 * se  # the conservative convention under-rejects


def test_every_token_when_null_stride_is_1_or_none(gpt2):
    model, tok = gpt2
    batch = _batch(tok)
    for stride in (None, 1):
        with eh.monitor(model, targets=[("ov", "modulus")], null_stride=stride) as mon, torch.no_grad():
            model(**batch)
        df = mon.summary()
        assert (df["null_tokens"] == df["n_tokens"]).all()
        assert np.allclose(df["rho_null_tokens"], df["rho"])


def test_null_stride_must_be_positive(gpt2):
    model, _ = gpt2
    with pytest.raises(ValueError, match=r"null_stride must be a positive int \(1: every token\)"):
        eh.monitor(model, null_stride=0)


def test_default_subsample_takes_the_same_positions_of_every_sequence(gpt2):
    """The null subsample is chosen by each token's index in its own sequence (every 5th valid
    token: 0, 5, 10, ...), so every row of a batch gives it the same positions, whatever the
    row's place in the batch and whatever n is: position 0 (the attention sink) is one of the
    ceil(n/5) kept positions of each row, as likely as any other kept position, in every layout.
    (The old rule, every 5th token of the batch's flat grid, made the share depend on n.)"""
    model, _ = gpt2
    for b, n in ((8, 128), (3, 7), (5, 12)):
        ids = torch.randint(5, 200, (b, n), generator=torch.Generator().manual_seed(n))
        at = {}
        for pos in (0, 1, 5):
            only = torch.zeros(b, n, dtype=torch.long)
            only[:, : pos + 1] = 1  # the first pos+1 positions count: null_tokens counts those kept
            with eh.monitor(model, targets=[("ov", "modulus")], attention_mask=only) as mon, torch.no_grad():
                model(input_ids=ids)
            at[pos] = float(mon.summary()["null_tokens"].iloc[0])
        with eh.monitor(model, targets=[("ov", "modulus")]) as mon, torch.no_grad():
            model(input_ids=ids)
        total = float(mon.summary()["null_tokens"].iloc[0])
        assert at[0] == at[1] == b  # position 0 of every row, and not position 1
        assert at[5] == (2 * b if n > 5 else b)  # then position 5
        assert total == b * -(-n // 5)  # ceil(n/5) positions of each row


def test_dropping_the_structured_nulls_leaves_the_haar_test_as_it_is(gpt2):
    """docs/concepts.md ("What the monitor costs"): fnull_draws=0, eig_top=0 cut the cost and keep
    p_null, q_null, the band and the verdict exactly; only eig_rank and fnull_percentile go."""
    model, tok = gpt2
    batch = _batch(tok)
    out = {}
    for name, kw in (("full", {}), ("haar", {"fnull_draws": 0, "eig_top": 0})):
        with eh.monitor(model, **kw) as mon, torch.no_grad():
            model(**batch)
        out[name] = mon.summary()
    full, haar = out["full"], out["haar"]
    for col in (
        "rho",
        "rho_null_tokens",
        "null_rho_lo",
        "null_rho_hi",
        "rho_percentile",
        "p_null",
        "q_null",
        "verdict",
    ):
        assert full[col].equals(haar[col]), col
    assert full["eig_rank"].notna().all() and full["fnull_percentile"].notna().all()
    assert haar["eig_rank"].isna().all() and haar["fnull_percentile"].isna().all()
