"""What the direction is: per-head and per-group spectra, the full OV circuit, token readouts, ranking.

Every reference is computed here from the raw weights (o_proj, v_proj, the embeddings, the norms)
with numpy, never through the adapters: F_h = o_proj[:, h] @ v_proj[h // (H/G)] by hand.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as T
from harness import DECODER_BASE, assert_tiny

import eigenhooks as eh
from eigenhooks.linalg import Factors, part_spectra

H, G, D, DH = 4, 2, 16, 4  # DECODER_BASE: 4 query heads read 2 kv groups, d = 16, d_head = 4


def _llama(seed=0, tied=False):
    torch.manual_seed(seed)
    model = T.LlamaForCausalLM(T.LlamaConfig(**DECODER_BASE, tie_word_embeddings=tied))
    assert_tiny(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.double().eval()


@pytest.fixture(scope="module")
def llama():
    return _llama()


def _raw_heads(model, layer, ln=False):
    """[F_h] (d, d) numpy, from o_proj and v_proj with the GQA map h -> h // (H/G); and the layer's F."""
    attn = model.model.layers[layer].self_attn
    O = attn.o_proj.weight.detach().numpy()  # (d, H*dh)
    V = attn.v_proj.weight.detach().numpy()  # (G*dh, d)
    if ln:
        V = V * model.model.layers[layer].input_layernorm.weight.detach().numpy()[None, :]
    F_h = [O[:, h * DH : (h + 1) * DH] @ V[(h // (H // G)) * DH : (h // (H // G) + 1) * DH] for h in range(H)]
    V_full = np.concatenate([V[(h // (H // G)) * DH : (h // (H // G) + 1) * DH] for h in range(H)])  # (H*dh, d)
    return F_h, O @ V_full


def _nonzero(w, tol=1e-9):
    return w[np.abs(w) > tol * np.abs(w).max()]


def _same_multiset(a, b, tol):
    a, b = np.sort_complex(np.round(a, 9)), np.sort_complex(np.round(b, 9))
    assert len(a) == len(b), (a, b)
    for x in a:
        j = int(np.argmin(np.abs(b - x)))
        assert abs(b[j] - x) < tol, (x, b)
        b = np.delete(b, j)


def _score(w, rank):
    return np.abs(w) if rank == "modulus" else np.abs(1 + w)


def _check_part(part, F, rank):
    """Eigenvalues, principal subspace (among nonzero eigenvalues), k and copying of a part against numpy on F."""
    w, vr = np.linalg.eig(F)
    nz = np.abs(w) > 1e-9 * np.abs(w).max()
    _same_multiset(_nonzero(part.eigenvalues.numpy()), w[nz], 1e-9)
    s = _score(part.eigenvalues.numpy(), rank)
    assert np.all(np.diff(s) <= 1e-12), "eigenvalues not sorted by the rank's score"
    j = np.flatnonzero(nz)[int(np.argmax(_score(w[nz], rank)))]
    v = vr[:, j]
    ref = np.stack([v.real, v.imag], 1) if abs(w[j].imag) > 1e-9 * abs(w[j]) else v.real[:, None]
    ref = np.linalg.qr(ref)[0]
    U = part.basis.numpy()
    assert U.shape == (D, part.k) == ref.shape
    np.testing.assert_allclose(U.T @ U, np.eye(part.k), atol=1e-12)
    np.testing.assert_allclose(U @ U.T, ref @ ref.T, atol=1e-8)  # the same subspace
    np.testing.assert_allclose(part.copying_score, w.real.sum() / np.abs(w).sum(), atol=1e-12)


@pytest.mark.parametrize("rank", ["modulus", "residual"])
@pytest.mark.parametrize("variant", ["ov", "ov_ln"])
def test_heads_and_groups_against_raw_weights(llama, rank, variant):
    specs = eh.spectra(llama, variant=variant, rank=rank, heads=True, cache=False)
    for s in specs:
        F_h, F = _raw_heads(llama, s.layer, ln=variant == "ov_ln")
        assert [h.head for h in s.heads] == list(range(H))
        for h in s.heads:
            _check_part(h, F_h[h.head], rank)
        assert [g.heads for g in s.groups] == [[0, 1], [2, 3]]
        for g in s.groups:
            _check_part(g, sum(F_h[h] for h in g.heads), rank)
        # the groups' F sum to the layer's
        np.testing.assert_allclose(sum(sum(F_h[h] for h in g.heads) for g in s.groups), F, atol=1e-12)


def test_heads_follow_the_rank():
    # one head whose small side has eigenvalues -0.3, -0.1 and 0: under `residual` the zero
    # (|1 + 0| = 1) would outrank both, but a head's null space is no direction it writes
    g = torch.Generator().manual_seed(1)
    Q = torch.linalg.qr(torch.randn(8, 3, generator=g, dtype=torch.float64))[0]
    O, V = Q, torch.diag(torch.tensor([-0.3, -0.1, 0.0], dtype=torch.float64)) @ Q.T
    f = Factors.from_stacked(O, V, n_heads=1)
    parts = part_spectra(f, ("modulus", "residual"))
    mod, res = parts["modulus"][0][0], parts["residual"][0][0]
    assert abs(mod.lambda_1 - (-0.3)) < 1e-12 and abs(res.lambda_1 - (-0.1)) < 1e-12
    assert complex(res.eigenvalues[0]) == 0  # listed by score, zeros included
    torch.testing.assert_close(res.basis.abs(), Q[:, 1:2].abs(), atol=1e-12, rtol=0)
    assert res.gap_ratio == pytest.approx(0.7 / 0.9) and mod.gap_ratio == pytest.approx(0.1 / 0.3)


def test_heads_are_not_shared_between_ranks(llama):
    by_rank = (
        eh.spectra(llama, rank="modulus", heads=True, cache=False),
        eh.spectra(llama, rank="residual", heads=True, cache=False),
    )
    assert by_rank[0][0].heads is not by_rank[1][0].heads
    assert by_rank[1][0].heads[0].eigenvalues.shape == (DH,)


@pytest.mark.parametrize("variant", ["ov", "ov_ln"])
def test_circuit_copying_against_the_dense_vocab_matrix(llama, variant):
    W_E = llama.model.embed_tokens.weight.detach().numpy()  # (vocab, d)
    W_U = llama.lm_head.weight.detach().numpy() * llama.model.norm.weight.detach().numpy()[None, :]
    for s in eh.spectra(llama, variant=variant, heads=True, cache=False):
        F_h, _ = _raw_heads(llama, s.layer, ln=variant == "ov_ln")
        for h in s.heads:
            w = np.linalg.eigvals(W_U @ F_h[h.head] @ W_E.T)  # (vocab, vocab): entry (i, j) = logit i from token j
            assert abs(h.circuit_copying - w.real.sum() / np.abs(w).sum()) < 1e-6
        for g in s.groups:
            w = np.linalg.eigvals(W_U @ sum(F_h[i] for i in g.heads) @ W_E.T)
            assert abs(g.circuit_copying - w.real.sum() / np.abs(w).sum()) < 1e-6


def test_circuit_copying_is_cached_with_its_embeddings(llama):
    first = eh.spectra(llama, heads=True)
    again = eh.spectra(llama, heads=True)
    assert [h.circuit_copying for h in first[0].heads] == [h.circuit_copying for h in again[0].heads]
    from eigenhooks.spectra import clear_memo

    clear_memo()
    disk = eh.spectra(llama, heads=True)  # from the disk cache: every field survives the round trip
    for a, b in zip(first[0].heads + first[0].groups, disk[0].heads + disk[0].groups):
        assert (a.k, a.kind, a.gap_ratio, a.copying_score, a.circuit_copying) == (
            b.k,
            b.kind,
            b.gap_ratio,
            b.copying_score,
            b.circuit_copying,
        )
        torch.testing.assert_close(a.basis, b.basis)
    with torch.no_grad():  # the unembedding changes: F does not, circuit copying does
        llama.lm_head.weight.mul_(-1)
    try:
        flipped = eh.spectra(llama, heads=True)
        assert flipped[0].heads[0].circuit_copying == pytest.approx(-first[0].heads[0].circuit_copying)
    finally:
        with torch.no_grad():
            llama.lm_head.weight.mul_(-1)


def test_no_unembedding_says_so_in_one_line(caplog):
    bare = _llama().model  # LlamaModel: no LM head
    with caplog.at_level("WARNING"):
        s = eh.spectra(bare, heads=True, cache=False)
    assert all(np.isnan(h.circuit_copying) for h in s[0].heads)
    assert any("circuit copying is NaN" in r.getMessage() for r in caplog.records)


def test_returned_heads_and_groups_are_the_callers_own():
    """Editing what eh.spectra returned never reaches the memo: heads, groups and their tensors (issue 52)."""
    model = _llama(seed=3)
    first = eh.spectra(model, heads=True)
    want = [(h.head, h.basis.clone(), h.eigenvalues.clone()) for h in first[0].heads]
    want_groups = [(list(g.heads), g.basis.clone()) for g in first[0].groups]
    for _ in range(2):  # the first call's objects, then a memo hit's
        got = eh.spectra(model, heads=True)
        got[0].heads.pop()
        got[0].heads[0].basis.mul_(-1)
        got[0].heads[1].eigenvalues.zero_()
        got[0].groups[0].heads.append(99)
        got[0].groups[1].basis.mul_(-1)
        first[0].heads.clear()
    again = eh.spectra(model, heads=True)
    assert [h.head for h in again[0].heads] == [h for h, _, _ in want]
    for h, (_, basis, eig) in zip(again[0].heads, want):
        assert torch.equal(h.basis, basis) and torch.equal(h.eigenvalues, eig)
    for g, (heads, basis) in zip(again[0].groups, want_groups):
        assert g.heads == heads and torch.equal(g.basis, basis)


def test_shared_weight_layers_get_spectra_of_their_own():
    """ALBERT's layers share one F, not one object: editing layer 0's spectrum leaves layer 1's (issue 52's kin)."""
    model, _ = eh.zoo.load("albert-tiny")
    specs = eh.spectra(model, heads=True)
    assert len(specs) >= 2 and specs[0].lambda_1 == specs[1].lambda_1
    basis, heads = specs[1].basis.clone(), len(specs[1].heads)
    specs[0].basis.mul_(-1)
    specs[0].eigenvalues.zero_()
    specs[0].heads.pop()
    specs[0].groups[0].basis.mul_(-1)
    assert torch.equal(specs[1].basis, basis) and len(specs[1].heads) == heads
    assert specs[1].lambda_1 != 0 and not torch.equal(specs[1].groups[0].basis, specs[0].groups[0].basis)
