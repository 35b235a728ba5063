"""The real-model tier for what a direction is: SmolLM2's heads (GQA: 9 query heads read 3 kv groups).

References are numpy on the raw weights (o_proj, v_proj, embed_tokens, the final norm), never the adapters.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from zoo.test_smollm2_real_tier import _own_F

import eigenhooks as eh

pytestmark = pytest.mark.real
H, G, DH = 9, 3, 64


def _own_heads(model, layer: int) -> list[np.ndarray]:
    """[F_h] (576, 576) with head h reading kv group h // 3, from o_proj and v_proj by hand."""
    a = model.model.layers[layer].self_attn
    O = a.o_proj.weight.detach().double().numpy()  # (d, H*dh)
    V = a.v_proj.weight.detach().double().numpy()  # (G*dh, d)
    return [O[:, h * DH : (h + 1) * DH] @ V[(h // (H // G)) * DH : (h // (H // G) + 1) * DH] for h in range(H)]


@pytest.fixture(scope="module")
def specs(smollm2):
    return eh.spectra(smollm2[0], layers=[0, 13, 29], heads=True, cache=False)


@pytest.mark.parametrize("i", [0, 1, 2])
def test_heads_and_groups_match_raw_weights(smollm2, specs, i):
    model, _ = smollm2
    s = specs[i]
    F_h = _own_heads(model, s.layer)
    assert len(s.heads) == H and [g.heads for g in s.groups] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    np.testing.assert_allclose(sum(F_h), _own_F(model, s.layer), atol=1e-9)  # heads (and groups) sum to F
    for part, F in [(h, F_h[h.head]) for h in s.heads] + [(g, sum(F_h[j] for j in g.heads)) for g in s.groups]:
        w = np.linalg.eigvals(F)
        w = w[np.argsort(-np.abs(w))][:DH]  # rank <= 64: the rest is zero
        got = part.eigenvalues.numpy()
        np.testing.assert_allclose(np.sort(np.abs(got)), np.sort(np.abs(w)), atol=1e-8 * np.abs(w).max())
        U = part.basis.numpy()
        lam = part.lambda_1
        if part.k == 1:  # U spans an eigenvector: F u = lambda u
            assert np.linalg.norm(F @ U[:, 0] - lam.real * U[:, 0]) < 1e-7 * abs(lam)
        else:  # U spans an invariant plane
            FU = F @ U
            assert np.linalg.norm(FU - U @ (U.T @ FU)) < 1e-7 * np.linalg.norm(FU)
        assert abs(part.copying_score - w.real.sum() / np.abs(w).sum()) < 1e-8


def test_circuit_copying_against_the_d_sized_product(smollm2, specs):
    """W_U F_h W_Eᵀ shares its nonzero eigenvalues with F_h (W_Eᵀ W_U), 576 x 576 here: numpy's eig of that
    is another route than ours (the 64 x 64 V_h (W_Eᵀ W_U) O_h)."""
    model, _ = smollm2
    W_E = model.model.embed_tokens.weight.detach().double().numpy()  # (vocab, d)
    W_U = model.lm_head.weight.detach().double().numpy() * model.model.norm.weight.detach().double().numpy()
    C = W_E.T @ W_U  # (d, d)
    s = specs[2]
    F_h = _own_heads(model, s.layer)
    for h in s.heads[:3]:
        w = np.linalg.eigvals(F_h[h.head] @ C)
        assert abs(h.circuit_copying - w.real.sum() / np.abs(w).sum()) < 1e-6


def test_bridge_heads_equal_hf(smollm2):
    lens = pytest.importorskip("transformer_lens")
    model, tok = smollm2
    bridge = lens.TransformerBridge.boot_transformers(
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        hf_model=copy.deepcopy(model),  # the bridge takes over its model's modules in place:
        tokenizer=tok,  # a private copy keeps the session's shared SmolLM2 a plain HF model
    )
    for a, b in zip(
        eh.spectra(model, layers=[29], heads=True, cache=False),
        eh.spectra(bridge, layers=[29], heads=True, cache=False),
    ):
        for p, q in zip(a.heads + a.groups, b.heads + b.groups):
            assert p.k == q.k
            np.testing.assert_allclose(
                p.basis.numpy() @ p.basis.numpy().T, q.basis.numpy() @ q.basis.numpy().T, atol=1e-6
            )
            assert abs(p.circuit_copying - q.circuit_copying) < 1e-6


def test_readout_of_v1_and_its_null(smollm2, specs):
    model, tok = smollm2
    r = eh.read_tokens(model, tok, specs[2], k=10, null_draws=100)
    assert len(r.top) == 10 and r.null_lo < r.null_hi
    own = eh.read_tokens(model, tok, eh.direction.token(model, tok, " Paris", objective="logit"), k=1, null_draws=50)
    assert own.top[0][0] == " Paris" and own.score > own.null_hi
