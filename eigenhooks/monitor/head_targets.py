"""Head targets: each query head's principal subspace as a monitor target (docs/concepts.md, "Head targets").

``targets=[("ov_head", "modulus")]`` (or ``"residual"``) measures, at every layer, each head's
principal subspace ``HeadSpectrum.basis`` of F_h = O_h V_{g(h)} (``eh.spectra(model, heads=True)``,
ranked by the target's rule) as a target of its own: one summary row per (layer, head), named
``ov_head/modulus/h3`` with ``head`` = 3. What is measured is the whole layer's update against that
subspace, so the statistics are those of the same basis given as a custom target; ``eig_rank``
ranks it among the layer's F (not the head's) top eigen-subspaces, under the target's rule. A head
whose F_h is zero (k = 0) has no subspace and no row.

This is a target kind resolved in the plan: the reduction engine sees ordinary ``TargetSpec``s.
Two things keep the layer targets' numbers what they were without head targets: the rows are a
Benjamini-Hochberg family of their own (``summary.family``), and the null frames are drawn at the
layer targets' width and only widened for head targets (``widen``), so the layer rows' draws never
move.
"""

from __future__ import annotations

import torch

HEAD_KINDS = {"ov_head": "ov"}  # target kind -> the variant whose heads it reads
WIDEN_SEED = 2000  # plan.seed's ``which`` of the Haar frames' extra columns; + 1 + j for the j-th F-null


def is_head_target(t) -> bool:
    """Whether ``t`` is a head target, ``(kind, rank)`` with kind in ``HEAD_KINDS``."""
    return isinstance(t, tuple | list) and len(t) == 2 and isinstance(t[1], str) and t[0] in HEAD_KINDS


def row_name(name: str, head: int) -> str:
    """The row (and sink tag, fingerprint key) of head ``head`` of head target ``name``: 'ov_head/modulus/h3'."""
    return f"{name}/h{head}"


def heads_of(spec) -> list:
    """The ``HeadSpectrum``s of a layer spectrum computed with ``heads=True`` that have a subspace (k >= 1)."""
    return [p for p in spec.heads or [] if p.k > 0]


def frame_widths(ks: list[int], head: list[bool]) -> tuple[int, int]:
    """(k_draw, k_max) of a layer's null frames: drawn at its layer targets' widest k (at its head
    targets' when it has no other), then widened to every target's widest."""
    layer_ks = [k for k, h in zip(ks, head) if not h]
    return max(layer_ks or ks), max(ks)


def widen(frames: torch.Tensor, k_max: int, seed: int, apply_F=None) -> torch.Tensor:
    """Frames (K, d, k0) with k_max - k0 columns more, their first k0 columns unchanged.

    The new columns are Gaussian (or F times Gaussian, ``apply_F`` mapping (d, m) to F @ it, as
    ``measures.fnull.power_step_frames``), orthogonalised against the frame and among themselves: Gram-Schmidt
    on independent columns, so a Haar frame stays Haar and an F-null frame stays orth(F g_1 .. F g_k).
    """
    K, d, k0 = frames.shape
    extra = k_max - k0
    if extra <= 0:
        return frames
    g = torch.Generator().manual_seed(int(seed))
    G = torch.randn(d, K * extra, generator=g, dtype=torch.float64)
    if apply_F is not None:
        G = apply_F(G)
    G = G.T.reshape(K, extra, d).transpose(1, 2)  # (K, d, extra)
    for _ in range(2):  # twice: orthogonal to working precision
        G = G - frames @ (frames.transpose(1, 2) @ G)
    Q, R = torch.linalg.qr(G)
    Q = Q * torch.sign(torch.diagonal(R, dim1=-2, dim2=-1))[:, None, :]
    return torch.cat([frames, Q], 2)
