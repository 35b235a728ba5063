"""Spectra of a factored layer matrix F = O V, in float64.

Pure torch: this module takes tensors and returns tensors or dataclasses, and knows
nothing about any model library. Conventions (docs/design.md, "Mathematics"): column vectors,
F v = lambda v (right eigenvectors), eigenvalues ranked by ``modulus`` (|lambda|) or
``residual`` (|1 + lambda|, the dominant eigenvalue of I + F).
"""

from __future__ import annotations

import numpy as np
import torch

from .factors import Factors
from .heads import part_spectra
from .ranking import (  # noqa: F401  (re-exported: callers import the ranking rules from here)
    DEFAULT_THRESHOLD,
    DEFAULT_TOP,
    KINDS,
    RANKS,
    HeadSpectrum,
    LayerSpectrum,
    principal,
    rank_scores,
    sort_eigenvalues,
)


def real_eigvals(M: torch.Tensor) -> torch.Tensor:
    """All eigenvalues of a real square float64 matrix, without vectors: (n,) complex128.

    LAPACK ``dgeev`` (no vectors) through numpy's OpenBLAS, faster than torch's on a Llama-8B
    layer's small side (docs/scale.md, "Figures behind the code").
    """
    w = np.linalg.eigvals(M.detach().cpu().numpy())  # numpy releases the GIL in LAPACK (see full_eig)
    return torch.from_numpy(np.asarray(w, dtype=np.complex128))


# More wanted eigenvectors than this: one full eigen-decomposition (values and vectors together)
# costs less than eigenvalues plus an inverse iteration (an LU) for each vector. The monitor asks
# for 2 * eig_top = 32 vectors under two ranking rules at once; the CLI's spectra for 4.
FULL_EIG_VECTORS = 8


def full_eig(M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All eigenvalues and right eigenvectors of a real square float64 matrix: (n,), (n, n) complex128.

    LAPACK ``dgeev`` through numpy, which releases the GIL while LAPACK runs: layers decomposed side
    by side in threads really run side by side (scipy's wrapper holds the GIL, which serialised
    them: docs/scale.md, "Figures behind the code"). Columns are unit vectors,
    M v_i = w_i v_i.
    """
    w, vr = np.linalg.eig(M.detach().cpu().numpy())
    return torch.from_numpy(np.asarray(w, np.complex128)), torch.from_numpy(np.asarray(vr, np.complex128))


def _matmul(A: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A @ x for a real A and a real or complex x, without a complex copy of A."""
    if not x.is_complex():
        return A @ x
    return torch.complex(A @ x.real.contiguous(), A @ x.imag.contiguous())


def _inverse_iteration(F: torch.Tensor, lam: complex, against: list[torch.Tensor], iters: int = 3) -> torch.Tensor:
    """A unit eigenvector of F for the (known) eigenvalue lam, by shifted inverse iteration.

    Real eigenvalues use a real factorisation (4x cheaper than a complex one). ``against``
    holds vectors already found for the same (repeated) eigenvalue: they are projected out
    at every step, so a repeated eigenvalue gets independent vectors of its eigenspace.
    """
    d = F.shape[0]
    real = lam.imag == 0 and all(not u.is_complex() or not u.imag.any() for u in against)
    dtype = torch.float64 if real else torch.complex128
    # Shift off the eigenvalue so the factorisation is not exactly singular.
    shift = (lam.real if real else lam) + (abs(lam) + 1.0) * 1e-10
    S = F.to(dtype, copy=True)
    S.diagonal().sub_(shift)  # F - shift I, without a d x d identity
    lu, piv = torch.linalg.lu_factor(S)
    g = torch.Generator().manual_seed(d + len(against))
    v = torch.randn(d, generator=g, dtype=torch.float64)
    if not real:
        v = torch.complex(v, torch.randn(d, generator=g, dtype=torch.float64))
    Q = None
    if against:
        A = torch.stack(against, 1)  # (d, j)
        Q = torch.linalg.qr(A.real if real else A)[0]  # orthonormal basis of the vectors found
    for _ in range(iters):
        v = torch.linalg.lu_solve(lu, piv, v[:, None])[:, 0]
        if Q is not None:
            v = v - Q @ (Q.conj().T @ v)
        v = v / torch.linalg.vector_norm(v)
    return v.to(torch.complex128)


def _dense_top_vectors(F: torch.Tensor, eigenvalues: torch.Tensor, m: int) -> torch.Tensor:
    """Eigenvectors of dense F (n, n) for the given eigenvalues, (n, m) complex128.

    Shifted inverse iteration per eigenvalue; a full eig is the fallback when a residual is
    poor (e.g. a defective eigenvalue). A conjugate's vector is the conjugate of its partner's.
    """
    vecs: list[torch.Tensor] = []
    done: list[tuple[complex, torch.Tensor]] = []
    scale = max(float(torch.linalg.matrix_norm(F)), 1e-300)  # Frobenius: cheap, >= the 2-norm
    close = 1e-7 * scale  # eigenvalues this close are treated as one repeated eigenvalue
    wanted = eigenvalues[:m].tolist()
    for lam in wanted:
        partner = next((u for mu, u in done if lam.imag != 0 and mu == lam.conjugate()), None)
        if partner is not None and not any(mu == lam for mu, _ in done):
            vecs.append(partner.conj())
            done.append((lam, vecs[-1]))
            continue
        v = _inverse_iteration(F, lam, [u for mu, u in done if abs(mu - lam) < close])
        resid = float(torch.linalg.vector_norm(_matmul(F, v) - lam * v))
        if not np.isfinite(resid) or resid > 1e-8 * scale:
            return _full_eig_vectors(F, wanted)
        done.append((lam, v))
        vecs.append(v)
    return torch.stack(vecs, 1)


def _full_eig_vectors(F: torch.Tensor, wanted: list[complex]) -> torch.Tensor:
    """The fallback: a full eig, each wanted eigenvalue matched to its nearest unused one."""
    vals, full = torch.linalg.eig(F)
    free = torch.ones(len(vals), dtype=torch.bool)
    cols = []
    for x in wanted:
        j = int(torch.argmin(torch.where(free, (vals - x).abs(), torch.inf)))
        free[j] = False
        cols.append(full[:, j])
    return torch.stack(cols, 1)


class NonFiniteError(ValueError):
    """The attention weights (O or V) hold inf or NaN entries."""


def _finite(M: torch.Tensor) -> torch.Tensor:
    """M itself, after checking it is finite.

    An inf or NaN entry of O or V always reaches V O (inf times anything is inf or NaN), so
    checking the r x r product replaces two checks of the d x r factors (~8x fewer entries
    on a Llama-8B layer).
    """
    if not torch.isfinite(M).all():
        raise NonFiniteError("non-finite entries in the attention weights (O or V)")
    return M


def _leading(eigenvalues: torch.Tensor, top: int, ranks: tuple[str, ...], extra: int = 0) -> list[int]:
    """Indices of the ``top + extra`` leading eigenvalues under each ranking rule (their union)."""
    idx: set[int] = set()
    for rank in ranks:
        idx.update(sort_eigenvalues(eigenvalues, rank)[: top + extra].tolist())
    return sorted(idx)


def _small_side(O: torch.Tensor, V: torch.Tensor, top: int, ranks: tuple[str, ...]):
    """eig_factored for r = O.shape[1] < d: eigenvalues only of the r x r small side V O,
    then vectors only for the leading few.

    The nonzero eigenvalues of F = O V are those of M = V O; if M y = mu y then v = O y
    satisfies F v = O (V O y) = mu v. y comes from inverse iteration on M (an LU of r x r
    per wanted eigenvalue), so no full eig with vectors is ever computed. A zero eigenvalue
    among the leading ones takes its vectors from null(V) (F null(V) = 0).
    """
    d, r = O.shape
    M = _finite(V @ O)  # (r, r)
    full = top * len(ranks) > FULL_EIG_VECTORS and r > 0
    mu, Y_all = full_eig(M) if full else (real_eigvals(M), None)  # (r,) complex128 [, (r, r)]
    eigenvalues = torch.cat([mu, torch.zeros(d - r, dtype=mu.dtype)])  # (d,)
    zero_tol = 1e-12 * max(float(mu.abs().max()), 1e-300) if r else 0.0
    want = _leading(eigenvalues, top, ranks)
    nonzero = [i for i in want if i < r and abs(complex(mu[i])) > zero_tol]
    n_zero = len(want) - len(nonzero)
    vals = mu[nonzero]
    vecs = torch.zeros(d, 0, dtype=torch.complex128)
    if nonzero:
        # (r, c): M y = mu y, from the full decomposition or by inverse iteration for each
        Y = Y_all[:, nonzero] if full else _dense_top_vectors(M, vals, len(nonzero))
        vecs = _matmul(O, Y)  # (d, c): v = O y
        vecs = vecs / torch.linalg.vector_norm(vecs, dim=0)
    if n_zero:
        _, _, Vh = torch.linalg.svd(V, full_matrices=True)  # rows r.. of Vh span part of null(V)
        null = Vh[r : r + n_zero].T.to(torch.complex128)  # (d, n_zero)
        vals = torch.cat([vals, torch.zeros(null.shape[1], dtype=mu.dtype)])
        vecs = torch.cat([vecs, null], 1)
    return eigenvalues, vecs, vals


def eig_factored(
    O: torch.Tensor, V: torch.Tensor, top: int = DEFAULT_TOP, ranks: tuple[str, ...] = RANKS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All eigenvalues of F = O V and right eigenvectors for the leading few.

    Uses the small side when r = O.shape[1] < d: the nonzero eigenvalues of O V are those of
    V O (r x r), with eigenvectors v = O y; the other d - r eigenvalues are 0. Either way,
    only eigenvalues are computed for the whole matrix (``eigvals``), and eigenvectors only
    for the leading ones, by shifted inverse iteration (a full ``eig`` is the fallback when
    an inverse-iteration residual is poor). When more than ``FULL_EIG_VECTORS`` vectors are
    wanted (top times the ranking rules), one full ``eig`` gives them all at once instead.

    Args:
        O: (d, r) float64. V: (r, d) float64.
        top: how many leading eigenvectors to return for each ranking rule in ``ranks``.
        ranks: the ranking rules whose leading eigenvalues need vectors.

    Returns:
        (eigenvalues (d,) complex128, vectors (d, c) complex128, values_of_vectors (c,)): the
        candidate eigenpairs, for the leading eigenvalues under every rule in ``ranks``.
    """
    d, r = O.shape
    if r < d:
        return _small_side(O, V, top, ranks)
    F = _finite(O @ V)
    # The dense path keeps torch's eigvals: faster inside eh.spectra on GPT-2-small's dense
    # layers (docs/scale.md, "Figures behind the code").
    if top * len(ranks) > FULL_EIG_VECTORS:
        eigenvalues, all_vecs = full_eig(F)
        cand = _leading(eigenvalues, top, ranks, extra=1)
        return eigenvalues, all_vecs[:, cand], eigenvalues[cand]
    eigenvalues = torch.linalg.eigvals(F)
    cand = _leading(eigenvalues, top, ranks, extra=1)
    vals = eigenvalues[cand]
    vecs = _dense_top_vectors(F, vals, len(cand))
    return eigenvalues, vecs, vals


def layer_spectra(
    factors: Factors,
    *,
    ranks: tuple[str, ...] = ("modulus",),
    layer: int = 0,
    variant: str = "ov",
    top: int = DEFAULT_TOP,
    threshold: float = DEFAULT_THRESHOLD,
    heads: bool = False,
    circuit: torch.Tensor | None = None,
) -> dict[str, LayerSpectrum]:
    """``layer_spectrum`` under several ranking rules, from one eigen-decomposition: {rank: spectrum}.

    ``circuit`` (d, d) is W_Eᵀ W_U for the heads' ``circuit_copying`` (``linalg.heads.part_spectra``).
    """
    for rank in ranks:
        rank_scores(torch.zeros(1), rank)  # validates rank
    O, V = factors.stacked(torch.float64)
    try:
        eigenvalues, vecs, vals = eig_factored(O, V, top=top, ranks=tuple(ranks))
    except NonFiniteError as e:
        raise NonFiniteError(f"layer {layer}: {e}") from None
    out = {
        rank: principal(eigenvalues, vecs, vals, layer=layer, variant=variant, rank=rank, top=top, threshold=threshold)
        for rank in ranks
    }
    if heads:  # each rule ranks its own heads and groups
        for rank, (h, g) in part_spectra(factors, tuple(ranks), threshold, circuit).items():
            out[rank].heads, out[rank].groups = h, g
    return out


def layer_spectrum(
    factors: Factors,
    *,
    layer: int = 0,
    variant: str = "ov",
    rank: str = "modulus",
    top: int = DEFAULT_TOP,
    threshold: float = DEFAULT_THRESHOLD,
    heads: bool = False,
) -> LayerSpectrum:
    """Spectrum of F = Ô V for one layer's factors.

    Args:
        factors: the layer's factors (any dtype or device; computed in float64 on the CPU).
        variant: a label stored with the result; fold norms in with ``Factors.scaled`` first.
        rank: 'modulus' or 'residual'.
        top: number of leading eigenvectors to keep.
        threshold: gap ratio above which the layer is 'near-degenerate'.
        heads: also compute each head's and each key/value group's spectrum (``heads``, ``groups``).

    Example:
        >>> f = Factors.from_stacked(torch.eye(4), torch.diag(torch.tensor([3., 1, 1, 1])), 2)
        >>> layer_spectrum(f).lambda_1
        (3+0j)
    """
    return layer_spectra(
        factors, ranks=(rank,), layer=layer, variant=variant, top=top, threshold=threshold, heads=heads
    )[rank]
