"""Spectra of the parts of a layer: each head's F_h = O_h V_{g(h)}, each key/value group's F_g.

Pure torch and numpy (docs/design.md, "What a direction is"). Column convention: F acts on
column vectors. A part's F has rank <= d_head, so everything goes through its small side
M = V O (d_head x d_head): its eigenvalues are F's nonzero ones, and an eigenvector y of M
gives F's eigenvector v = O y. The full OV circuit W_U F W_Eᵀ is handled the same way: its
nonzero eigenvalues are those of V (W_Eᵀ W_U) O, so the vocab x vocab matrix is never formed.
"""

from __future__ import annotations

import numpy as np
import torch

from .factors import Factors
from .ranking import DEFAULT_THRESHOLD, ZERO_TOL, GroupSpectrum, HeadSpectrum, PartSpectrum, principal, sort_eigenvalues


def copying(mu: torch.Tensor) -> float:
    """Re(sum mu) / sum |mu|: +1 for a pure copier, -1 for a pure suppressor, 0 for no eigenvalue."""
    total = float(mu.abs().sum())
    return float(mu.real.sum()) / total if total > 0 else 0.0


def _part(
    O: torch.Tensor, V: torch.Tensor, ranks: tuple[str, ...], threshold: float, VC: torch.Tensor | None
) -> dict[str, dict]:
    """{rank: the fields of a PartSpectrum} of F = O V, O (d, dh), V (dh, d), float64; VC = V W_Eᵀ W_U (dh, d)."""
    d = O.shape[0]
    w, y = np.linalg.eig((V @ O).numpy())  # the small side, all pairs (dh is small)
    mu, Y = torch.from_numpy(w.astype(np.complex128)), torch.from_numpy(y.astype(np.complex128))  # (dh,), (dh, dh)
    nonzero = mu.abs() > ZERO_TOL * max(float(mu.abs().max()), 1e-300)
    copy = copying(mu)
    circ = float("nan")
    if VC is not None:
        circ = copying(torch.from_numpy(np.linalg.eigvals((VC @ O).numpy())))  # (dh, dh): V_h (W_Eᵀ W_U) O_h
    out = {}
    for rank in ranks:
        fields = {"eigenvalues": mu[sort_eigenvalues(mu, rank)], "copying_score": copy, "circuit_copying": circ}
        if not bool(nonzero.any()):
            out[rank] = {**fields, "basis": torch.zeros(d, 0, dtype=torch.float64), "k": 0}
            out[rank].update(kind="near-degenerate", gap_ratio=float("nan"))
            continue
        vals = mu[nonzero]
        vecs = torch.complex(O @ Y[:, nonzero].real.contiguous(), O @ Y[:, nonzero].imag.contiguous())  # (d, c)
        vecs = vecs / torch.linalg.vector_norm(vecs, dim=0)
        s = principal(vals, vecs, vals, layer=0, variant="", rank=rank, top=1, threshold=threshold)
        out[rank] = {**fields, "basis": s.basis, "k": s.k, "kind": s.kind, "gap_ratio": s.gap_ratio}
    return out


def part_spectra(
    factors: Factors,
    ranks: tuple[str, ...] = ("modulus",),
    threshold: float = DEFAULT_THRESHOLD,
    circuit: torch.Tensor | None = None,
) -> dict[str, tuple[list[HeadSpectrum], list[GroupSpectrum]]]:
    """Every head's and every key/value group's spectrum, under each ranking rule.

    Args:
        factors: the layer's factors (any dtype or device; computed in float64 on the CPU).
        ranks: the ranking rules; each gets its own lists (a head's principal subspace follows the rule).
        threshold: gap ratio above which a part is 'near-degenerate'.
        circuit: (d, d) float64 W_Eᵀ W_U, the embedding's transpose times the (final-norm-scaled)
            unembedding, for ``circuit_copying``; None leaves it NaN.

    Returns:
        {rank: (heads, groups)}: H HeadSpectrum and G GroupSpectrum, in index order.

    Example:
        >>> f = Factors.from_stacked(torch.eye(4), torch.diag(torch.tensor([3., 1, 1, 1])), 2)
        >>> heads, groups = part_spectra(f)["modulus"]
        >>> heads[0].lambda_1, groups[1].heads
        ((3+0j), [1])
    """
    O_h = factors.O_heads.detach().to("cpu", torch.float64)  # (H, d, dh)
    V_g = factors.V_groups.detach().to("cpu", torch.float64)  # (G, dh, d)
    of = factors.group_of_head.cpu()
    if circuit is not None:
        circuit = circuit.to("cpu", torch.float64)
    heads: dict[str, list[HeadSpectrum]] = {r: [] for r in ranks}
    groups: dict[str, list[GroupSpectrum]] = {r: [] for r in ranks}
    VC = [None if circuit is None else V @ circuit for V in V_g]  # (dh, d) per group, shared by its heads
    for h in range(O_h.shape[0]):
        for r, f in _part(O_h[h], V_g[int(of[h])], ranks, threshold, VC[int(of[h])]).items():
            heads[r].append(HeadSpectrum(head=h, **f))
    for g in range(V_g.shape[0]):
        members = [h for h in range(O_h.shape[0]) if int(of[h]) == g]
        O = O_h[members].sum(0) if members else torch.zeros_like(O_h[0])  # (d, dh): the group's Ô
        for r, f in _part(O, V_g[g], ranks, threshold, VC[g]).items():
            groups[r].append(GroupSpectrum(group=g, heads=members, **f))
    return {r: (heads[r], groups[r]) for r in ranks}


# --- the disk cache's view of the parts: flat tensors, one row per part ---

_KINDS = ("real-dominant", "complex-dominant", "near-degenerate")


def part_tensors(prefix: str, parts: list[PartSpectrum]) -> dict[str, torch.Tensor]:
    """The parts' fields as tensors named ``prefix_*`` (bases padded to 2 columns; k says how many count)."""
    d = parts[0].basis.shape[0]
    basis = torch.zeros(len(parts), d, 2, dtype=torch.float64)
    for i, p in enumerate(parts):
        basis[i, :, : p.k] = p.basis
    eig = torch.stack([p.eigenvalues for p in parts])
    t = {
        f"{prefix}_eig_re": eig.real.contiguous(),
        f"{prefix}_eig_im": eig.imag.contiguous(),
        f"{prefix}_basis": basis,
        f"{prefix}_k": torch.tensor([p.k for p in parts]),
        f"{prefix}_kind": torch.tensor([_KINDS.index(p.kind) for p in parts]),
        f"{prefix}_num": torch.tensor(
            [[p.gap_ratio, p.copying_score, p.circuit_copying] for p in parts], dtype=torch.float64
        ),
    }
    if prefix == "group":
        of = torch.full((len(parts), max(len(p.heads) for p in parts)), -1)
        for i, p in enumerate(parts):
            of[i, : len(p.heads)] = torch.tensor(p.heads, dtype=torch.long)
        t["group_heads"] = of
    return t


def parts_from_tensors(prefix: str, t: dict[str, torch.Tensor]) -> list | None:
    """The inverse of ``part_tensors``: a list of HeadSpectrum ('head') or GroupSpectrum ('group'), or None."""
    if f"{prefix}_eig_re" not in t:
        return None
    eig = torch.complex(t[f"{prefix}_eig_re"], t[f"{prefix}_eig_im"])
    out = []
    for i in range(eig.shape[0]):
        k = int(t[f"{prefix}_k"][i])
        gap, copy, circ = (float(x) for x in t[f"{prefix}_num"][i])
        fields = dict(
            eigenvalues=eig[i],
            basis=t[f"{prefix}_basis"][i, :, :k].contiguous(),
            k=k,
            kind=_KINDS[int(t[f"{prefix}_kind"][i])],
            gap_ratio=gap,
            copying_score=copy,
            circuit_copying=circ,
        )
        if prefix == "head":
            out.append(HeadSpectrum(head=i, **fields))
        else:
            members = [int(h) for h in t["group_heads"][i] if h >= 0]
            out.append(GroupSpectrum(group=i, heads=members, **fields))
    return out
