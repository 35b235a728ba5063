"""The null's token subsample: the target is compared with the draws on the same tokens."""

import numpy as np
import pytest
import torch

import eigenhooks as eh
from eigenhooks.metrics import alignment, mc_p_value


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
    layer, cap = 1, 48
    with eh.monitor(model, targets=[("ov", "modulus")], null_tokens=cap) as mon, torch.no_grad():
        model(**batch)
    row = mon.summary().set_index("layer").loc[layer]
    pre, mid = _readings(model, batch, layer)
    stride = -(-b * n // cap)
    assert stride > 1, "the test must exercise the subsample"
    sel = torch.zeros(b * n, dtype=torch.bool)
    sel[::stride] = True
    sel = sel.view(b, n) & batch["attention_mask"].bool()
    U = eh.spectra(model)[layer].basis.float()
    up = (alignment(mid, U) - alignment(pre, U)) > 1e-6
    assert row["null_tokens"] == int(sel.sum())
    assert abs(row["rho_null_tokens"] - float(up[sel].double().mean())) < 1e-9
    assert abs(row["rho"] - float(up[batch["attention_mask"].bool()].double().mean())) < 1e-9
    # the draws, from the reducer's own frames, on the same tokens: the same quantiles and p
    red = mon._layers[layer]["reducer"]
    H = red.Bn64[:, red.haar_start : red.haar_start + red.K * red.k_max].float()
    draws = []
    for j in range(red.K):
        Q = H[:, j * red.k_max : j * red.k_max + int(row["k"])]
        u = (alignment(mid, Q) - alignment(pre, Q)) > 1e-6
        draws.append(float(u[sel].double().mean()))
    draws = np.array(draws)
    assert abs(draws.mean() - row["null_rho_mean"]) < 1e-9
    assert abs(np.quantile(draws, 0.025) - row["null_rho_lo"]) < 1e-9
    assert abs(mc_p_value(row["rho_null_tokens"], draws) - row["p_null"]) < 1e-12


def test_every_token_when_the_batch_is_small_or_null_tokens_is_none(gpt2):
    model, tok = gpt2
    batch = _batch(tok)
    for cap in (None, 10_000):
        with eh.monitor(model, targets=[("ov", "modulus")], null_tokens=cap) as mon, torch.no_grad():
            model(**batch)
        df = mon.summary()
        assert (df["null_tokens"] == df["n_tokens"]).all()
        assert np.allclose(df["rho_null_tokens"], df["rho"])


def test_null_tokens_must_be_positive(gpt2):
    model, _ = gpt2
    with pytest.raises(ValueError, match="null_tokens must be a positive int or None"):
        eh.monitor(model, null_tokens=0)
