"""Ranking rules and the principal subspace: which eigenvalue of F is lambda_1, and ``LayerSpectrum``.

Pure torch and numpy. ``modulus`` ranks by |lambda|, ``residual`` by |1 + lambda| (the dominant
eigenvalue of I + F); ``principal`` picks lambda_1, its subspace (k = 1, or the real plane of a
complex pair), the gap ratio and the kind (docs/design.md, "Principal eigenpair").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from . import views

RANKS = ("modulus", "residual")
KINDS = ("real-dominant", "complex-dominant", "near-degenerate")
DEFAULT_THRESHOLD = 0.99
DEFAULT_TOP = 4
# An eigenvalue whose imaginary part is below this share of its modulus counts as real.
# LAPACK returns exact zeros for real eigenvalues of a real matrix, so this only matters
# for eigenvalues recovered through the small side.
_IMAG_TOL = 1e-9


# An eigenvalue of a part below this share of its largest is zero: the part's null space is
# not a direction it writes, so it never enters the principal subspace, the gap or the kind.
ZERO_TOL = 1e-9


@dataclass(kw_only=True)
class PartSpectrum:
    """Spectrum of one part of a layer (a head or a key/value group), F_part = O V of rank <= d_head.

    Attributes:
        eigenvalues: (d_head,) complex128, the eigenvalues of the small side V O, sorted by the
            call's ranking rule (score |mu| or |1 + mu|), descending; zeros included.
        basis: (d, k) float64, orthonormal: the principal subspace of F_part, chosen among the
            nonzero eigenvalues only (|mu| > 1e-9 max|mu|); (d, 0) when every eigenvalue is zero.
        k: 1 (real mu_1), 2 (complex mu_1: span(Re v_1, Im v_1)) or 0 (a zero part).
        kind: 'real-dominant', 'complex-dominant' or 'near-degenerate', by the layer's rules on
            the nonzero eigenvalues ('near-degenerate' for a zero part).
        gap_ratio: score(mu_next) / score(mu_1) over the nonzero eigenvalues (0 when none is
            next, NaN for a zero part).
        copying_score: Re(sum mu) / sum |mu| over the eigenvalues of F_part.
        circuit_copying: Re(sum nu) / sum |nu| over the eigenvalues nu of the full OV circuit
            W_U F_part W_Eᵀ (NaN when the model has no unembedding).
    """

    eigenvalues: torch.Tensor
    basis: torch.Tensor
    k: int
    kind: str
    gap_ratio: float
    copying_score: float
    circuit_copying: float = float("nan")

    @property
    def lambda_1(self) -> complex:
        """The principal eigenvalue: the top-ranked nonzero one (0 for a zero part)."""
        mu = self.eigenvalues
        nz = mu[mu.abs() > ZERO_TOL * max(float(mu.abs().max()), 1e-300)] if mu.numel() else mu
        return complex(nz[0]) if nz.numel() else 0j

    def __repr__(self) -> str:  # a line, tensors by shape (views.py)
        return views.part_repr(self)

    def to_frame(self):
        """This part's row as a pandas DataFrame (layer, part, kind, lambda_1, |lambda_1|, k, gap, copying)."""
        return views.to_frame(self)

    def _repr_html_(self) -> str:
        return views.repr_html(self)


@dataclass(kw_only=True, repr=False)
class HeadSpectrum(PartSpectrum):
    """Spectrum of query head ``head``'s F_h = O_h V_{g(h)}, g(h) the key/value group it reads."""

    head: int


@dataclass(kw_only=True, repr=False)
class GroupSpectrum(PartSpectrum):
    """Spectrum of key/value group ``group``'s F_g = sum over its query heads ``heads`` of O_h V_g.

    The groups' F sum to the layer's F; without GQA each group is one head.
    """

    group: int
    heads: list[int]


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
        heads: with ``heads=True``, one HeadSpectrum per query head (ranked by this rule), else None.
        groups: with ``heads=True``, one GroupSpectrum per key/value group, else None.
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
    groups: list[GroupSpectrum] | None = field(default=None, repr=False)

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

    def __repr__(self) -> str:  # a line, tensors by shape (views.py): 30 layers fit a screen
        return views.layer_repr(self)

    def to_frame(self):
        """This layer's row, and one per head and group when it has them, as a pandas DataFrame.

        Example:
            >>> import pandas as pd  # doctest: +SKIP
            >>> pd.concat([s.to_frame() for s in eh.spectra(model, heads=True)])  # doctest: +SKIP
        """
        return views.to_frame(self)

    def _repr_html_(self) -> str:
        return views.repr_html(self)


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
