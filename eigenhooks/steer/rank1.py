"""The algebra of rank-1 steering: a change ΔO = a bᵀ of one layer's output matrix.

Pure torch, float64, CPU; no model library. Notation (docs/design.md, "Mathematics", docs/steering.md):
V is the stacked value map (H*d_head, d) — each query head's group's V_g, repeated under
GQA — and O (d, H*d_head) the output projection, so F = O V. A change ΔO = a bᵀ
(a in R^d, b in the stacked head space) gives F' = F + a cᵀ with c = Vᵀ b, and adds
a (bᵀ z) to a token whose heads' outputs are z (the output projection's input).

- ``paper``: a = alpha u, b = V u / ||V u|| (Li & Altafini). u is only approximately an
  eigenvector of F', and the push a (bᵀ z) has the sign of (V u)ᵀ z, token by token.
- ``exact``: a = lambda u - F u with bᵀ V u = 1, so F' u = lambda u exactly. The other
  eigenvalues of F' do not depend on lambda (``quotient_eigenvalues``), so the gap ratio
  fixes lambda in closed form. b is free up to bᵀ V u = 1: ``free_vector`` picks the
  symmetric choice V u / ||V u||², or a signed one from the data (the typical z).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..linalg import views
from ..linalg.eig import Factors, rank_scores


@dataclass
class Rank1:
    """A rank-1 change ΔO = a bᵀ of a layer's output projection.

    Attributes:
        a: (d,) float64, the direction added to the residual stream.
        b: (H*d_head,) float64, the read-out in the stacked head space (the projection's input).
        alpha: strength on the paper's scale: the u-component of F' u is uᵀF u + alpha ||V u||.
        lam: the eigenvalue of u under F' (exact construction), else None.
        method: 'exact' or 'paper'.
        signed: whether b was chosen from data so the typical token is pushed toward +u.
    """

    a: torch.Tensor
    b: torch.Tensor
    alpha: float
    lam: float | None
    method: str
    signed: bool

    def __repr__(self) -> str:  # a line, the vectors by shape (linalg/views.py)
        lam = "" if self.lam is None else f", λ={self.lam:.4g}"
        return (
            f"Rank1({self.method}, {'signed' if self.signed else 'unsigned'}, alpha={self.alpha:.4g}{lam}, "
            f"a {views.shape_of(self.a)}, b {views.shape_of(self.b)})"
        )

    def matrix(self) -> torch.Tensor:
        """ΔO = a bᵀ, (d, H*d_head): the layout of an nn.Linear weight (out, in)."""
        return torch.outer(self.a, self.b)


def value_stack(factors: Factors) -> torch.Tensor:
    """V (H*d_head, d), float64: each query head's value projection (its group's, under GQA)."""
    V = factors.V_groups.detach().to("cpu", torch.float64)[factors.group_of_head.cpu()]  # (H, d_head, d)
    return V.reshape(-1, V.shape[-1])


def steered_factors(factors: Factors, change: Rank1) -> Factors:
    """Factors of F' = (O + a bᵀ) V: b (H*d_head,) is split into the query heads' slices."""
    H, d, dh = factors.O_heads.shape
    O = factors.O_heads.detach().to("cpu", torch.float64)  # (H, d, d_head)
    O = O + change.a[None, :, None] * change.b.reshape(H, 1, dh)
    return Factors(O, factors.V_groups.detach().to("cpu", torch.float64), factors.group_of_head)


def paper(factors: Factors, u: torch.Tensor, alpha: float) -> Rank1:
    """The paper's change O' = O + alpha u wᵀ, w = V u / ||V u||.

    Args:
        u: (d,) unit float64.
        alpha: its size.
    """
    Vu = value_stack(factors) @ u
    return Rank1(alpha * u, Vu / torch.linalg.vector_norm(Vu), float(alpha), None, "paper", False)


def free_vector(Vu: torch.Tensor, z_mean: torch.Tensor | None = None) -> torch.Tensor:
    """The read-out b with bᵀ V u = 1: symmetric, or signed by the typical token.

    Without data, b = V u / ||V u||² (the minimum-norm choice; the push then has the sign of
    (V u)ᵀ z, token by token, as in the paper). With z_mean, the mean of the heads' outputs z
    over calibration tokens, b is the minimum-norm vector with

        bᵀ e_1 = bᵀ e_2 = 1 / ||V u||,   e_1 = V u / ||V u||, e_2 = z_mean / ||z_mean||,

    that is b = (e_1 + e_2) / (||V u|| (1 + e_1ᵀ e_2)): the typical token is pushed toward
    +u as strongly as a token whose value is V u scaled to the same length.

    Args:
        Vu: (H*d_head,) V u. z_mean: (H*d_head,) or None.

    Raises:
        ValueError: z_mean is zero, or points along -V u (no signed read-out exists).
    """
    n = torch.linalg.vector_norm(Vu)
    if z_mean is None:
        return Vu / n**2
    m = torch.linalg.vector_norm(z_mean)
    if not m > 0:
        raise ValueError("the calibration tokens' mean head output is zero; pass other calibration inputs or sign=None")
    e1, e2 = Vu / n, z_mean / m
    c = float(e1 @ e2)
    if c < -1 + 1e-6:
        raise ValueError(
            f"the calibration tokens' mean head output points along -V u (cos {c:.6f}): no read-out "
            "pushes them toward +u while keeping u an eigenvector; pass sign=None"
        )
    return (e1 + e2) / (n * (1 + c))


def quotient_eigenvalues(factors: Factors, u: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The eigenvalues of F' = F + (lambda u - F u) cᵀ other than lambda, for any lambda.

    In an orthonormal basis [u, Q] of R^d, F' is block triangular with the block
    Qᵀ F (I - u cᵀ) Q, which has no lambda in it (c = Vᵀ b, cᵀ u = 1). Its eigenvalues are
    those of P F (I - u cᵀ) (P = I - u uᵀ) less one zero; that product is factored as
    (P Ô)(V (I - u cᵀ)) so the small side (G*d_head) does the work.

    Returns:
        (d - 1,) complex128.
    """
    O, V = factors.stacked(torch.float64)  # Ô (d, G*d_head), V (G*d_head, d)
    c = value_stack(factors).T @ b  # (d,)
    PO = O - torch.outer(u, u @ O)
    VQ = V - torch.outer(V @ u, c)
    d, r = PO.shape
    if r < d:  # the nonzero eigenvalues of (P Ô)(V (I - u cᵀ)) are those of the r x r product
        small = torch.linalg.eigvals(VQ @ PO)
        eigenvalues = torch.cat([small, torch.zeros(d - r, dtype=small.dtype)])
    else:
        eigenvalues = torch.linalg.eigvals(PO @ VQ)
    drop = int(torch.argmin(eigenvalues.abs()))  # the zero of P's kernel (u)
    return torch.cat([eigenvalues[:drop], eigenvalues[drop + 1 :]])


def exact(factors: Factors, u: torch.Tensor, b: torch.Tensor, lam: float, signed: bool = False) -> Rank1:
    """ΔO = (lambda u - F u) bᵀ with bᵀ V u = 1, so that F' u = lambda u exactly."""
    Vu = value_stack(factors) @ u
    F_u = factors.matrix() @ u
    alpha = (lam - float(u @ F_u)) / float(torch.linalg.vector_norm(Vu))
    return Rank1(lam * u - F_u, b, alpha, float(lam), "exact", signed)


def lambda_for_gap(mu: torch.Tensor, gap_ratio: float, rank: str = "modulus") -> float:
    """The positive eigenvalue lambda whose score beats every mu by 1 / gap_ratio.

    modulus: |lambda| = max|mu| / r; residual: |1 + lambda| = max|1 + mu| / r.

    Raises:
        ValueError: all mu are 0 under the modulus rule (any lambda gives gap 0).
    """
    top = float(rank_scores(mu, rank).max())
    if not top > 0:
        raise ValueError("every other eigenvalue of F' is 0: any lambda gives gap ratio 0; pass alpha instead")
    return top / gap_ratio if rank == "modulus" else top / gap_ratio - 1.0


def lambda_for_alpha(factors: Factors, u: torch.Tensor, alpha: float) -> float:
    """lambda = uᵀ F u + alpha ||V u||: the u-component the paper's change gives F' u."""
    Vu = value_stack(factors) @ u
    return float(u @ (factors.matrix() @ u)) + alpha * float(torch.linalg.vector_norm(Vu))
