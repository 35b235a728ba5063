"""spectrum.py against numpy.linalg.eig and against its own small-side / dense paths."""

import gc

import numpy as np
import pytest
import torch
from harness import build

import eigenhooks as eh
from eigenhooks.linalg import cache as disk
from eigenhooks.linalg import eig
from eigenhooks.linalg.eig import Factors, layer_spectrum, rank_scores
from eigenhooks.spectra import compute


def _random_factors(d=24, H=4, G=4, dh=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    O = torch.randn(d, H * dh, generator=g, dtype=torch.float64)
    V = torch.randn(G * dh, d, generator=g, dtype=torch.float64)
    return Factors.from_stacked(O, V, H, G)


def _match(a, b, tol):
    """Every eigenvalue in a has a distinct partner in b within tol."""
    b = list(b)
    for x in a:
        j = int(np.argmin([abs(x - y) for y in b]))
        assert abs(x - b[j]) < tol, (x, b[j])
        b.pop(j)


@pytest.mark.parametrize("H,G", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("rank", ["modulus", "residual"])
def test_eigenvalues_match_numpy(H, G, rank):
    f = _random_factors(H=H, G=G, seed=H + G)
    s = layer_spectrum(f, rank=rank)
    ref = np.linalg.eig(f.matrix().numpy()).eigenvalues
    _match(s.eigenvalues.numpy(), ref, 1e-9)
    scores = rank_scores(s.eigenvalues, rank)
    assert torch.all(scores[:-1] >= scores[1:] - 1e-12), "eigenvalues are not sorted by the ranking rule"
    assert (
        abs(s.lambda_1 - ref[np.argmax(np.abs(ref if rank == "modulus" else 1 + ref))]) < 1e-9
        or abs(s.lambda_1 - np.conj(ref[np.argmax(np.abs(ref if rank == "modulus" else 1 + ref))])) < 1e-9
    )


@pytest.mark.parametrize("H,G", [(4, 4), (4, 2)])
def test_top_eigenvectors_are_right_eigenvectors(H, G):
    f = _random_factors(H=H, G=G)
    F = f.matrix().to(torch.complex128)
    s = layer_spectrum(f, top=4)
    for i in range(4):
        v, lam = s.eigenvectors[:, i], s.eigenvalues[i]
        torch.testing.assert_close(F @ v, lam * v, atol=1e-10, rtol=0)
        assert abs(float(torch.linalg.vector_norm(v)) - 1) < 1e-12


def test_small_side_equals_dense_on_gqa_shape():
    """GQA-shaped layer (rank n_kv*d_head < d): small side vs a dense eig of the same F."""
    f = _random_factors(d=48, H=8, G=2, dh=6, seed=3)  # rank 12 < 48
    small = layer_spectrum(f)
    F = f.matrix()
    dense = layer_spectrum(Factors(F[None], torch.eye(48, dtype=torch.float64)[None], torch.zeros(1, dtype=torch.long)))
    _match(small.eigenvalues.numpy(), dense.eigenvalues.numpy(), 1e-9)
    assert small.kind == dense.kind and small.k == dense.k
    torch.testing.assert_close(small.basis, dense.basis, atol=1e-9, rtol=0)
    assert abs(small.gap_ratio - dense.gap_ratio) < 1e-9


def test_complex_principal_plane_and_gap_skips_conjugate():
    d = 6
    theta = 0.7
    F = torch.zeros(d, d, dtype=torch.float64)
    F[:2, :2] = 2.0 * torch.tensor([[np.cos(theta), -np.sin(theta)], [np.sin(theta), np.cos(theta)]])
    F[2:, 2:] = torch.diag(torch.tensor([1.5, 0.5, 0.2, 0.1], dtype=torch.float64))
    s = layer_spectrum(Factors(F[None], torch.eye(d, dtype=torch.float64)[None], torch.zeros(1, dtype=torch.long)))
    assert s.kind == "complex-dominant" and s.k == 2
    assert s.lambda_1.imag > 0 and abs(s.lambda_1 - 2 * np.exp(1j * theta)) < 1e-12
    assert abs(s.gap_ratio - 1.5 / 2.0) < 1e-12  # the conjugate is not "next"
    P = s.basis @ s.basis.T
    torch.testing.assert_close(P[:2, :2], torch.eye(2, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(s.basis.T @ s.basis, torch.eye(2, dtype=torch.float64), atol=1e-12, rtol=0)


def test_residual_rank_reorders_negative_eigenvalues():
    F = torch.diag(torch.tensor([-1.8, 1.2, 0.3], dtype=torch.float64))
    f = Factors(F[None], torch.eye(3, dtype=torch.float64)[None], torch.zeros(1, dtype=torch.long))
    assert abs(layer_spectrum(f, rank="modulus").lambda_1 - (-1.8)) < 1e-12
    r = layer_spectrum(f, rank="residual")
    assert abs(r.lambda_1 - 1.2) < 1e-12  # |1 + 1.2| = 2.2 > |1 - 1.8| = 0.8
    assert abs(r.gap_ratio - 1.3 / 2.2) < 1e-12


def test_near_degenerate_and_deterministic_sign():
    F = torch.diag(torch.tensor([1.0, -0.9995, 0.1], dtype=torch.float64))
    f = Factors(F[None], torch.eye(3, dtype=torch.float64)[None], torch.zeros(1, dtype=torch.long))
    s = layer_spectrum(f)
    assert s.kind == "near-degenerate" and s.gap_ratio > 0.99
    f2 = Factors((-1 * F)[None] * -1, torch.eye(3, dtype=torch.float64)[None], torch.zeros(1, dtype=torch.long))
    s2 = layer_spectrum(f2)
    assert s.basis[0, 0] > 0 and torch.equal(s.basis, s2.basis)


def test_head_copying_score():
    # head 0 copies (F_0 = 2 I on its subspace), head 1 anti-copies
    d = 4
    O = torch.eye(d, dtype=torch.float64)
    V = torch.diag(torch.tensor([2.0, 2.0, -1.0, -1.0], dtype=torch.float64))
    s = layer_spectrum(Factors.from_stacked(O, V, 2), heads=True)
    assert [round(h.copying_score, 12) for h in s.heads] == [1.0, -1.0]


def test_bad_rank_and_non_finite():
    f = _random_factors()
    with pytest.raises(ValueError, match="rank must be one of"):
        layer_spectrum(f, rank="spectral")
    f.O_heads[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="layer 3: non-finite"):
        layer_spectrum(f, layer=3)


@pytest.mark.parametrize("where", ["O", "V"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("small", [True, False])
def test_non_finite_reaches_the_checked_product(where, bad, small):
    # The finiteness check runs on V O (or O V): one bad entry anywhere must still be caught,
    # also next to zeros (inf * 0 = nan) and on the dense path.
    f = _random_factors(G=2) if small else _random_factors()  # r = 12 < d = 24, or r = d
    t = f.O_heads if where == "O" else f.V_groups
    t.zero_()
    t[tuple(n // 2 for n in t.shape)] = bad
    with pytest.raises(ValueError, match="non-finite entries in the attention weights"):
        layer_spectrum(f)


def test_factor_shapes_checked():
    with pytest.raises(ValueError, match="do not fit"):
        Factors.from_stacked(torch.zeros(8, 8), torch.zeros(6, 8), n_heads=2)


# --- the fast path: eigenvalues only of the small side, vectors by inverse iteration ---


def _planted(eigs, d=40, seed=0, blocks=()):
    """Factors with V O = S M0 S^-1, M0 = diag(eigs) plus 2x2 rotation blocks (r x r, r < d).

    blocks: (rho, theta) pairs, each a complex pair rho exp(+-i theta).
    """
    g = torch.Generator().manual_seed(seed)
    parts = [torch.tensor([[float(x)]], dtype=torch.float64) for x in eigs]
    for rho, theta in blocks:
        c, s = rho * np.cos(theta), rho * np.sin(theta)
        parts.append(torch.tensor([[c, -s], [s, c]], dtype=torch.float64))
    M0 = torch.block_diag(*parts)
    r = M0.shape[0]
    S = torch.eye(r, dtype=torch.float64) + 0.3 * torch.randn(r, r, generator=g, dtype=torch.float64)
    Q, _ = torch.linalg.qr(torch.randn(d, r, generator=g, dtype=torch.float64))  # (d, r) orthonormal
    O = Q @ S  # (d, r)
    V = torch.linalg.solve(S, M0) @ Q.T  # (r, d): V O = S^-1 M0 S, same spectrum as M0
    return Factors.from_stacked(O, V, n_heads=1)


def _numpy_pairs(f):
    w, vr = np.linalg.eig(f.matrix().numpy())
    return w, vr


def _check_against_numpy(f, rank="modulus", top=4, vec_tol=1e-8, simple=True):
    """Fast path vs numpy's full eig of the dense F: values, right eigenvectors, residuals."""
    s = layer_spectrum(f, rank=rank, top=top)
    w, vr = _numpy_pairs(f)
    _match(s.eigenvalues.numpy(), w, 1e-9)
    F = f.matrix().to(torch.complex128)
    scale = float(torch.linalg.matrix_norm(F, ord=2))
    for i in range(top):
        v, lam = s.eigenvectors[:, i], s.eigenvalues[i]
        resid = float(torch.linalg.vector_norm(F @ v - lam * v))
        assert resid < 1e-10 * max(scale, 1.0), (i, complex(lam), resid)
        assert abs(float(torch.linalg.vector_norm(v)) - 1) < 1e-12
        if simple:  # a simple eigenvalue: numpy's vector is ours up to a phase
            j = int(np.argmin(np.abs(w - complex(lam))))
            overlap = abs(np.vdot(vr[:, j], v.numpy()))
            assert abs(overlap - 1) < vec_tol, (i, complex(lam), overlap)
    return s


@pytest.mark.parametrize("rank", ["modulus", "residual"])
@pytest.mark.parametrize(
    "d,H,G,dh",
    [(64, 8, 8, 4), (48, 8, 2, 6), (24, 4, 1, 4), (24, 4, 4, 6)],  # small side; GQA; MQA; dense (r = d)
)
def test_fast_path_equals_full_eig_random(d, H, G, dh, rank):
    _check_against_numpy(_random_factors(d=d, H=H, G=G, dh=dh, seed=d + G), rank=rank)


def test_fast_path_complex_dominant():
    f = _planted([1.2, 0.7, -0.5, 0.3], blocks=[(2.0, 0.9), (0.4, 2.0)])
    s = _check_against_numpy(f)
    assert s.kind == "complex-dominant" and s.k == 2
    assert abs(s.lambda_1 - 2 * np.exp(0.9j)) < 1e-10 and abs(s.gap_ratio - 1.2 / 2.0) < 1e-10
    # The principal plane is span(Re v_1, Im v_1) of numpy's v_1.
    w, vr = _numpy_pairs(f)
    v1 = vr[:, int(np.argmin(np.abs(w - s.lambda_1)))]
    U_np, _ = np.linalg.qr(np.stack([v1.real, v1.imag], 1))
    torch.testing.assert_close(s.basis @ s.basis.T, torch.from_numpy(U_np @ U_np.T), atol=1e-9, rtol=0)


def test_fast_path_near_degenerate():
    f = _planted([1.0, 0.9995, -0.6, 0.5, 0.2])
    s = _check_against_numpy(f, vec_tol=1e-6)
    assert s.kind == "near-degenerate" and abs(s.gap_ratio - 0.9995) < 1e-9


def test_fast_path_repeated_eigenvalue_gets_distinct_vectors():
    """lambda = 1 twice: any vectors of the eigenplane will do, but two distinct ones."""
    f = _planted([1.0, 1.0, 0.5, 0.25])
    s = _check_against_numpy(f, simple=False)
    G = s.eigenvectors[:, :2]
    sv = torch.linalg.svdvals(G)
    assert float(sv[1]) > 1e-3, f"the two vectors of the repeated eigenvalue are parallel: {sv=}"


def test_fast_path_zero_eigenvalues_lead_under_residual_rank():
    """All nonzero eigenvalues in (-2, 0): |1 + 0| = 1 outranks them, so the leading vectors
    come from null(V), and F v = 0 for them."""
    f = _planted([-0.5, -0.4, -0.3])
    s = _check_against_numpy(f, rank="residual", top=3, simple=False)
    assert s.lambda_1 == 0 and s.eigenvalues[:3].abs().max() == 0
    assert float(torch.linalg.svdvals(s.eigenvectors[:, :3])[-1]) > 1e-3


def test_fast_path_never_runs_a_full_eig(monkeypatch):
    """The speed comes from eigenvalues only: a full eig (with vectors) must not run."""

    def no_eig(*a, **k):
        raise AssertionError("torch.linalg.eig was called")

    monkeypatch.setattr(torch.linalg, "eig", no_eig)
    for H, G in [(8, 8), (8, 2)]:
        f = _random_factors(d=64, H=H, G=G, dh=4, seed=5)
        s = layer_spectrum(f, rank="residual")
        F = f.matrix().to(torch.complex128)
        torch.testing.assert_close(F @ s.v_1, s.lambda_1 * s.v_1, atol=1e-10, rtol=0)


# --- the in-process memo: keyed by every byte of the weights, never by identity or version ---


def _spectra_calls(monkeypatch):
    """Count eig runs and weight hashes behind eh.spectra."""
    calls = {"eig": 0, "hash": 0}
    real_eig, real_key = compute.layer_spectra, disk.cache_keys

    def eig(*a, **k):
        calls["eig"] += 1
        return real_eig(*a, **k)

    def key(*a, **k):
        calls["hash"] += 1
        return real_key(*a, **k)

    monkeypatch.setattr(compute, "layer_spectra", eig)
    monkeypatch.setattr(disk, "cache_keys", key)
    return calls


def _same(a, b):
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.eigenvalues, y.eigenvalues) and torch.equal(x.basis, y.basis)
        assert torch.equal(x.eigenvectors, y.eigenvectors) and (x.kind, x.gap_ratio) == (y.kind, y.gap_ratio)


def test_repeat_call_hashes_each_layer_once_and_never_recomputes(monkeypatch):
    model = build("llama")
    calls = _spectra_calls(monkeypatch)
    first = eh.spectra(model, variant="ov_ln", rank="residual")
    assert calls == {"eig": 2, "hash": 4}  # per layer: the memo's digest and the disk cache's key
    second = eh.spectra(model, variant="ov_ln", rank="residual")
    assert calls == {"eig": 2, "hash": 6}, "a repeat call recomputed, or hashed a layer more than once"
    _same(first, second)
    second[0].basis.mul_(-1)  # the caller's copy: the memo keeps its own
    _same(first, eh.spectra(model, variant="ov_ln", rank="residual"))
    compute.clear_memo()  # the disk cache (content-keyed) answers next: hash, no eig
    _same(first, eh.spectra(model, variant="ov_ln", rank="residual"))
    assert calls == {"eig": 2, "hash": 12}


def _numpy_lambda_1(o_proj_w, v_w) -> float:
    """|lambda_1| of F = O V straight from raw weights (nn.Linear layout), by numpy."""
    F = o_proj_w.detach().double().numpy() @ v_w.detach().double().numpy()
    return float(np.abs(np.linalg.eigvals(F)).max())


def test_data_edits_are_never_answered_from_the_memo():
    """Issue 41: ``.data`` writes keep ``_version`` and ``data_ptr``; a sample of entries missed them."""
    model, _ = eh.zoo.load("gpt2-tiny")
    d = model.config.n_embd  # GPT-2's Conv1D: c_attn (d, 3d), V = its last d columns; c_proj (d, d)
    eh.spectra(model)
    h2 = model.transformer.h[2].attn
    h2.c_attn.weight.data[:, 2 * d + 32 : 2 * d + 64] = 0  # ablate head 1's values
    after = eh.spectra(model)
    truth = _numpy_lambda_1(h2.c_proj.weight.T, h2.c_attn.weight[:, 2 * d :].T)
    assert abs(abs(after[2].lambda_1) - truth) < 1e-9 * truth, (abs(after[2].lambda_1), truth)
    h0 = model.transformer.h[0].attn
    h0.c_proj.weight.data[17, 33] += 5  # one entry: a strided sample of 16 misses it
    after = eh.spectra(model)
    truth = _numpy_lambda_1(h0.c_proj.weight.T, h0.c_attn.weight[:, 2 * d :].T)
    assert abs(abs(after[0].lambda_1) - truth) < 1e-9 * truth, (abs(after[0].lambda_1), truth)
    _same(after, eh.spectra(model, cache=False))


@pytest.mark.parametrize(
    "edit",
    [
        "no_grad_mul",  # bumps _version
        "one_entry",  # an unsampled entry: only _version tells
        "load_state_dict",  # copy_ under no_grad: bumps _version
        "data_assign",  # p.data = new tensor: new data_ptr
        "data_inplace",  # p.data.copy_(...): _version unchanged, caught by the content digest
        "to_dtype",  # model.float(): new storage and dtype
    ],
)
def test_in_place_weight_edit_gives_a_new_spectrum(edit):
    model = build("llama")
    before = eh.spectra(model, variant="ov_ln")
    key_before = compute.weights_digest(eh.get_adapter(model), 1)
    o = model.model.layers[1].self_attn.o_proj
    new = torch.randn(o.weight.shape, generator=torch.Generator().manual_seed(9), dtype=o.weight.dtype)
    with torch.no_grad():
        if edit == "no_grad_mul":
            o.weight.mul_(2.0)
        elif edit == "one_entry":
            o.weight[0, 1] += 1.0
        elif edit == "load_state_dict":
            o.load_state_dict({"weight": new})
        elif edit == "data_assign":
            o.weight.data = new
        elif edit == "data_inplace":
            o.weight.data.copy_(new)
        else:
            model.float()
    after = eh.spectra(model, variant="ov_ln")
    fresh = eh.spectra(model, variant="ov_ln", cache=False)
    _same(after, fresh)
    assert compute.weights_digest(eh.get_adapter(model), 1) != key_before  # the memo keys the edited layer anew
    if edit == "to_dtype":
        # build() draws float32 values, held in float64: float() keeps every value, and F is folded in float64
        # whatever the dtype (ov_ln's norm scale too), so the spectrum is the same numbers, computed anew
        _same(after, before)
    else:
        assert not torch.equal(after[1].eigenvalues, before[1].eigenvalues)
        _same(after[:1], before[:1])  # layer 0 untouched


def test_norm_edit_invalidates_ov_ln_only_where_it_matters():
    model = build("llama")
    ov, ln = eh.spectra(model), eh.spectra(model, variant="ov_ln")
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight.mul_(3.0)
    _same(ov, eh.spectra(model))
    ln2 = eh.spectra(model, variant="ov_ln")
    torch.testing.assert_close(ln2[0].eigenvalues, 3 * ln[0].eigenvalues)
    _same(ln2, eh.spectra(model, variant="ov_ln", cache=False))


def test_memo_never_serves_a_freed_model():

    for seed in range(3):  # freed models' addresses and ids get reused
        model = build("gpt2", seed=seed)
        _same(eh.spectra(model), eh.spectra(model, cache=False))
        del model
        gc.collect()


# --- the cuts for speed: each must give the same numbers as the plain computation ---


def test_real_eigvals_match_numpy_and_leave_the_input_alone():
    g = torch.Generator().manual_seed(11)
    M = torch.randn(30, 30, generator=g, dtype=torch.float64)
    before = M.clone()
    mu = eig.real_eigvals(M)
    assert mu.dtype == torch.complex128 and mu.shape == (30,)
    _match(mu.numpy(), np.linalg.eigvals(M.numpy()), 1e-10)
    assert torch.equal(M, before), "the eigvals overwrote its input (M is reused by inverse iteration)"
    sym = M + M.T  # all eigenvalues real: still complex128 (numpy would return float64 here)
    assert eig.real_eigvals(sym).dtype == torch.complex128


@pytest.mark.parametrize("groups", [None, [0, 1, 0, 1], [1, 1, 0, 0]])
def test_o_hat_sums_the_heads_of_each_group(groups):
    # None: HF's adjacent layout (a view of o_proj, summed); the others: the general index_add path.
    f = _random_factors(d=12, H=4, G=2, dh=3, seed=4)
    O_heads = f.O_heads.to(torch.float32)  # a float32 model: Ô is summed in float64
    if groups is not None:
        f = Factors(O_heads, f.V_groups, torch.tensor(groups))
    else:
        f = Factors(O_heads, f.V_groups, f.group_of_head)
    O, V = f.stacked(torch.float64)
    ref = np.zeros((2, 12, 3))
    for h, grp in enumerate(f.group_of_head.tolist()):
        ref[grp] += O_heads[h].double().numpy()
    torch.testing.assert_close(O, torch.from_numpy(ref.transpose(1, 0, 2).reshape(12, 6)), atol=0, rtol=0)
    O.add_(1.0)  # Ô is fresh: the model's weights are untouched
    assert torch.equal(f.O_heads, O_heads)


def test_cache_key_hashes_views_in_place_and_tells_layouts_apart():
    f = _random_factors(d=12, H=4, G=2, dh=3, seed=5)  # O_heads: a permuted view of a (d, H*dh) matrix
    assert not f.O_heads.is_contiguous()
    opts = {"variant": "ov"}
    key = disk.cache_key(f, None, opts)
    same = Factors(f.O_heads.contiguous(), f.V_groups.clone(), f.group_of_head.clone())
    assert disk.cache_key(same, None, opts) != key  # another layout: a miss, never a wrong hit
    copy = Factors.from_stacked(f.O_heads.permute(1, 0, 2).reshape(12, 12).clone(), f.V_groups.reshape(6, 12), 4, 2)
    assert disk.cache_key(copy, None, opts) == key  # same values, same layout: the same key
    for t in (f.O_heads, f.V_groups):  # one entry anywhere changes the key
        t[-1, -1, -1] += 1e-12
        assert disk.cache_key(f, None, opts) != key
        key = disk.cache_key(f, None, opts)
    strided = Factors(f.O_heads[:, ::2], f.V_groups[:, :, ::2], f.group_of_head)  # no permutation makes it dense
    dense = Factors(f.O_heads[:, ::2].contiguous(), f.V_groups[:, :, ::2].contiguous(), f.group_of_head)
    assert disk.cache_key(strided, None, opts) == disk.cache_key(dense, None, opts)
    X = torch.randn(1, 6, 6, dtype=torch.float64)  # X and its transpose: the same bytes in memory
    g = torch.zeros(1, dtype=torch.long)
    assert disk.cache_key(Factors(X, X, g), None, opts) != disk.cache_key(Factors(X, X.transpose(1, 2), g), None, opts)


def test_finiteness_is_checked_once_on_the_small_product(monkeypatch):
    # The d x r factors are never scanned for inf/nan before the eig: only V O (r x r) is.
    model = build("llama")  # d = 16, r = 2 kv heads x 4 = 8
    shapes = []
    real = torch.isfinite

    def spy(t):
        shapes.append(tuple(t.shape))
        return real(t)

    monkeypatch.setattr(torch, "isfinite", spy)
    eh.spectra(model, cache=False)
    assert shapes == [(8, 8), (8, 8)], shapes


@pytest.mark.parametrize("where", ["V", "norm"])
def test_non_finite_weight_is_named_after_the_eig_fails(where):
    model = build("llama")
    layer = model.model.layers[1]
    with torch.no_grad():
        if where == "V":
            layer.self_attn.v_proj.weight[2, 3] = float("nan")
        else:
            layer.input_layernorm.weight[5] = float("inf")
    if where == "norm":
        assert len(eh.spectra(model, cache=False)) == 2  # ov does not read the norm
    with pytest.raises(ValueError, match=rf"layer 1 .*non-finite values in .*{where} weights.*fp16 overflow"):
        eh.spectra(model, variant="ov_ln", cache=False)
