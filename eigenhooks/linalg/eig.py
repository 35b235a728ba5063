"""Spectra of a factored layer matrix F = O V, in float64.

Pure torch: this module takes tensors and returns tensors or dataclasses, and knows
nothing about any model library. Conventions (docs/design.md, "Mathematics"): column vectors,
F v = lambda v (right eigenvectors), eigenvalues ranked by ``modulus`` (|lambda|) or
``residual`` (|1 + lambda|, the dominant eigenvalue of I + F).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

RANKS = ("modulus", "residual")
KINDS = ("real-dominant", "complex-dominant", "near-degenerate")
DEFAULT_THRESHOLD = 0.99
DEFAULT_TOP = 4
# An eigenvalue whose imaginary part is below this share of its modulus counts as real.
# LAPACK returns exact zeros for real eigenvalues of a real matrix, so this only matters
# for eigenvalues recovered through the small side.
_IMAG_TOL = 1e-9


@dataclass
class Factors:
    """The attention factors of one layer, column convention, as the model stores them.

    Attributes:
        O_heads: (H, d, d_head) head h's slice of the output projection.
        V_groups: (G, d_head, d) the value projection of each key/value group.
        group_of_head: (H,) the group each head reads its values from (G == H without GQA).
    """

    O_heads: torch.Tensor
    V_groups: torch.Tensor
    group_of_head: torch.Tensor

    @classmethod
    def from_stacked(cls, O: torch.Tensor, V: torch.Tensor, n_heads: int, n_kv_heads: int | None = None):
        """Split O (d, H*d_head) and V (G*d_head, d) into heads; G = n_kv_heads or n_heads."""
        n_kv = n_kv_heads or n_heads
        d = O.shape[0]
        d_head = O.shape[1] // n_heads
        if O.shape[1] != n_heads * d_head or V.shape != (n_kv * d_head, d):
            raise ValueError(
                f"factor shapes do not fit {n_heads} heads / {n_kv} kv groups: {tuple(O.shape)=}, {tuple(V.shape)=}"
            )
        O_heads = O.reshape(d, n_heads, d_head).permute(1, 0, 2)  # (H, d, d_head)
        V_groups = V.reshape(n_kv, d_head, d)  # (G, d_head, d)
        group_of_head = torch.arange(n_heads) // (n_heads // n_kv)
        return cls(O_heads, V_groups, group_of_head)

    @property
    def d_model(self) -> int:
        return self.O_heads.shape[1]

    def stacked(self, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (Ô, V): Ô (d, G*d_head) sums the O_h of each group, V (G*d_head, d), so F = Ô V.

        Ô is always a fresh tensor; V may share the factors' storage when it is already
        ``dtype`` on the CPU (it is only read).
        """
        G, d_head, d = self.V_groups.shape
        V = self.V_groups.detach().to("cpu", dtype).reshape(G * d_head, d)
        return self._o_hat(dtype), V

    def _o_hat(self, dtype) -> torch.Tensor:
        """Ô (d, G*d_head): the sum of O_h over the heads of each group, computed in ``dtype``."""
        O_h = self.O_heads.detach().to("cpu")  # (H, d, d_head)
        H, d, d_head = O_h.shape
        G = self.V_groups.shape[0]
        groups = self.group_of_head.cpu()
        if H % G == 0 and torch.equal(groups, torch.arange(H) // (H // G)):
            # The heads of a group are adjacent (HF's GQA layout): (d, H, dh) -> (d, G, H/G, dh), a
            # view of the model's (d, H*dh) o_proj, summed over the heads of each group. No
            # index_add into zeros and no float64 copy of the permuted (H, d, dh) layout.
            O = O_h.permute(1, 0, 2).reshape(d, G, H // G, d_head)  # (d, G, H/G, dh)
            return O.sum(2, dtype=dtype).reshape(d, G * d_head)  # (d, G*dh), fresh, summed in dtype
        O_hat = torch.zeros(G, d, d_head, dtype=dtype)
        O_hat.index_add_(0, groups, O_h.to(dtype))
        return O_hat.permute(1, 0, 2).reshape(d, G * d_head)

    def matrix(self, dtype=torch.float64) -> torch.Tensor:
        """F = Ô V, (d, d)."""
        O, V = self.stacked(dtype)
        return O @ V

    def scaled(self, left: torch.Tensor | None = None, right: torch.Tensor | None = None) -> Factors:
        """Factors of diag(left) F diag(right): folds a norm's scale in (the ``ov_ln`` variant)."""
        O_heads, V_groups = self.O_heads, self.V_groups
        if left is not None:
            O_heads = O_heads * left.to(O_heads)[None, :, None]
        if right is not None:
            V_groups = V_groups * right.to(V_groups)[None, None, :]
        return Factors(O_heads, V_groups, self.group_of_head)


@dataclass
class HeadSpectrum:
    """Spectrum of one head's F_h = O_h V_h (rank <= d_head, zeros left out)."""

    head: int
    eigenvalues: torch.Tensor  # (d_head,) complex128, by modulus, descending
    copying_score: float  # Re(sum lambda) / sum |lambda|


@dataclass
class LayerSpectrum:
    """Spectrum of one layer's F under one variant and ranking rule.

    Attributes:
        eigenvalues: (d,) complex128, all eigenvalues, sorted by the ranking rule.
        eigenvectors: (d, m) complex128, unit right eigenvectors of the top m eigenvalues.
        basis: (d, k) float64, orthonormal basis U of the principal subspace.
        k: 1 for a real lambda_1, 2 for a complex one (span of Re v_1, Im v_1).
        gap_ratio: score(lambda_next) / score(lambda_1), lambda_next the top eigenvalue
            outside the principal subspace; score is |lambda| or |1 + lambda|.
        kind: 'real-dominant', 'complex-dominant' or 'near-degenerate'.
    """

    layer: int
    variant: str
    rank: str
    eigenvalues: torch.Tensor
    eigenvectors: torch.Tensor
    basis: torch.Tensor
    k: int
    gap_ratio: float
    kind: str
    lambda_next: complex
    threshold: float = DEFAULT_THRESHOLD
    heads: list[HeadSpectrum] | None = field(default=None, repr=False)

    @property
    def lambda_1(self) -> complex:
        return complex(self.eigenvalues[0])

    @property
    def v_1(self) -> torch.Tensor:
        return self.eigenvectors[:, 0]

    @property
    def d_model(self) -> int:
        return self.eigenvalues.shape[0]

    def score(self, lam) -> torch.Tensor:
        """The ranking score: |lambda| or |1 + lambda|."""
        lam = torch.as_tensor(lam)
        return (lam if self.rank == "modulus" else 1 + lam).abs()


def rank_scores(eigenvalues: torch.Tensor, rank: str) -> torch.Tensor:
    if rank not in RANKS:
        raise ValueError(f"rank must be one of {RANKS}, got {rank!r}")
    return (eigenvalues if rank == "modulus" else 1 + eigenvalues).abs()


def sort_eigenvalues(eigenvalues: torch.Tensor, rank: str) -> torch.Tensor:
    """Indices that sort by score, descending; ties (conjugate pairs) put +Im first."""
    s = rank_scores(eigenvalues, rank).numpy()
    order = np.lexsort((-eigenvalues.real.numpy(), -eigenvalues.imag.numpy(), -s))
    return torch.from_numpy(order.copy())


def _fix_phase(v: torch.Tensor) -> torch.Tensor:
    """Unit-normalise and rotate so the largest-magnitude entry is real and positive."""
    v = v / torch.linalg.vector_norm(v)
    i = int(torch.argmax(v.abs()))
    return v * (v[i].conj() / v[i].abs())


def _fix_sign(u: torch.Tensor) -> torch.Tensor:
    """Flip each column so its largest-magnitude entry is positive."""
    idx = u.abs().argmax(dim=0)
    signs = torch.sign(u[idx, torch.arange(u.shape[1])])
    signs[signs == 0] = 1
    return u * signs


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


def principal(
    eigenvalues: torch.Tensor,
    cand_vecs: torch.Tensor,
    cand_vals: torch.Tensor,
    *,
    layer: int,
    variant: str,
    rank: str,
    top: int = DEFAULT_TOP,
    threshold: float = DEFAULT_THRESHOLD,
) -> LayerSpectrum:
    """Rank eigenvalues, pick the principal subspace, and build the LayerSpectrum."""
    order = sort_eigenvalues(eigenvalues, rank)
    lam = eigenvalues[order]
    scores = rank_scores(lam, rank)
    lam1 = complex(lam[0])
    is_complex = abs(lam1.imag) > _IMAG_TOL * max(abs(lam1), 1e-300)
    skip = {0}
    if is_complex:
        # The conjugate belongs to the principal plane, so it is not "next".
        partner = int(torch.argmin((lam[1:] - np.conj(lam1)).abs())) + 1
        skip.add(partner)
    nxt = next((i for i in range(len(lam)) if i not in skip), None)
    s1 = float(scores[0])
    gap = float(scores[nxt]) / s1 if (nxt is not None and s1 > 0) else (1.0 if nxt is not None else 0.0)
    lambda_next = complex(lam[nxt]) if nxt is not None else complex("nan")

    # Match each top eigenvalue with its candidate eigenvector.
    m = min(top, len(lam))
    vecs = []
    free = torch.ones(len(cand_vals), dtype=torch.bool)
    for i in range(m):
        # Nearest unused candidate, so a repeated eigenvalue gets distinct vectors.
        dist = (cand_vals - lam[i]).abs()
        j = int(torch.argmin(torch.where(free, dist, torch.inf))) if free.any() else int(torch.argmin(dist))
        free[j] = False
        vecs.append(_fix_phase(cand_vecs[:, j]))
    eigenvectors = torch.stack(vecs, 1)
    v1 = eigenvectors[:, 0]
    if is_complex:
        U, _ = torch.linalg.qr(torch.stack([v1.real, v1.imag], 1))  # (d, 2)
        k = 2
    else:
        U = (v1.real / torch.linalg.vector_norm(v1.real))[:, None]
        k = 1
    U = _fix_sign(U)
    if gap > threshold:
        kind = "near-degenerate"
    elif is_complex:
        kind = "complex-dominant"
    else:
        kind = "real-dominant"
    return LayerSpectrum(
        layer=layer,
        variant=variant,
        rank=rank,
        eigenvalues=lam,
        eigenvectors=eigenvectors,
        basis=U,
        k=k,
        gap_ratio=gap,
        kind=kind,
        lambda_next=lambda_next,
        threshold=threshold,
    )


def head_spectra(factors: Factors) -> list[HeadSpectrum]:
    """Per-head spectra of F_h = O_h V_h through the small side eig(V_h O_h)."""
    out = []
    O_h = factors.O_heads.detach().to("cpu", torch.float64)
    V_g = factors.V_groups.detach().to("cpu", torch.float64)
    for h in range(O_h.shape[0]):
        mu = torch.linalg.eigvals(V_g[int(factors.group_of_head[h])] @ O_h[h])  # (d_head,)
        mu = mu[torch.argsort(mu.abs(), descending=True)]
        total = float(mu.abs().sum())
        score = float(mu.real.sum()) / total if total > 0 else 0.0
        out.append(HeadSpectrum(head=h, eigenvalues=mu, copying_score=score))
    return out


def layer_spectra(
    factors: Factors,
    *,
    ranks: tuple[str, ...] = ("modulus",),
    layer: int = 0,
    variant: str = "ov",
    top: int = DEFAULT_TOP,
    threshold: float = DEFAULT_THRESHOLD,
    heads: bool = False,
) -> dict[str, LayerSpectrum]:
    """``layer_spectrum`` under several ranking rules, from one eigen-decomposition: {rank: spectrum}."""
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
    if heads:
        per_head = head_spectra(factors)
        for spec in out.values():
            spec.heads = per_head
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
        heads: also compute per-head spectra.

    Example:
        >>> f = Factors.from_stacked(torch.eye(4), torch.diag(torch.tensor([3., 1, 1, 1])), 2)
        >>> layer_spectrum(f).lambda_1
        (3+0j)
    """
    return layer_spectra(
        factors, ranks=(rank,), layer=layer, variant=variant, top=top, threshold=threshold, heads=heads
    )[rank]
