"""A readout's p-value (``TokenReadout.p``, ``eigenhooks.spectra.tail``) bounds the Haar null's tail: checked
against 20,000 draws of the statistic on gpt2-tiny's rows (an independent numpy generator), and small
enough on a token's own row to survive a Benjamini-Hochberg correction over hundreds of readouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import eigenhooks as eh
from eigenhooks.spectra.tail import score_needed, tail_p


@pytest.fixture(scope="module")
def gpt2():
    return eh.zoo.load("gpt2-tiny")


def _rows(model):
    W = model.lm_head.weight.detach().double().numpy() * model.transformer.ln_f.weight.detach().double().numpy()
    return W / np.linalg.norm(W, axis=1, keepdims=True)


def _draws(W, m, k, n, rng):
    """The statistic of n Haar-random m-subspaces, computed here with numpy."""
    G = rng.standard_normal((n, W.shape[1], m))
    Q = np.linalg.qr(G)[0]  # (n, d, m)
    P = W @ Q  # (n, vocab, m); a batched BLAS product (np.einsum's loop took 22 of this test's 23.5 s)
    if m == 1:
        c = np.sort(P[..., 0], axis=1)
        return np.maximum(c[:, -k:].mean(1), -c[:, :k].mean(1))
    return np.sort(np.linalg.norm(P, axis=2), axis=1)[:, -k:].mean(1)


@pytest.mark.parametrize("m", [1, 2])
def test_the_bound_is_above_the_tail_of_twenty_thousand_draws(gpt2, m):
    model, tok = gpt2
    W = _rows(model)
    d, k = W.shape[1], 5
    s = np.concatenate([_draws(W, m, k, 2000, np.random.default_rng(i)) for i in range(10)])
    u = torch.randn(d, m, dtype=torch.float64)
    r = eh.read_tokens(model, tok, u if m == 2 else u[:, 0], k=k, null_draws=200)
    assert r.d == d and abs(r.null_mean - s.mean()) < 4 * s.std() / np.sqrt(200)
    for q in (0.5, 0.9, 0.99, 0.999, 0.9999):
        x = float(np.quantile(s, q))
        bound = tail_p(x, r.null_mean, r.null_sd, 200, d, m)
        assert bound >= (s >= x).mean(), (q, x, bound)  # never optimistic
    assert tail_p(float(s.max()) + 1.0, r.null_mean, r.null_sd, 200, d, m) < 1e-3  # and it does fall


def test_a_token_row_has_a_p_fine_enough_for_hundreds_of_readouts(gpt2):
    model, tok = gpt2
    W = _rows(model)
    t = int(np.argmax(np.linalg.norm(W, axis=1)))
    r = eh.read_tokens(model, tok, torch.from_numpy(W[t]), k=1, null_draws=100)
    assert r.p < 0.05 / 390 and r.p == tail_p(r.score, r.null_mean, r.null_sd, 100, r.d, 1)
    need = score_needed(r.p, r.null_mean, r.null_sd, 100, r.d, 1)
    assert need == pytest.approx(r.score)  # the inverse of the bound
    assert eh.read_tokens(model, tok, torch.from_numpy(W[t]), k=1, null_draws=0).p != r.p  # NaN: no draws
