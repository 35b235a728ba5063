"""The aten kernels a projection is made of, in float32 accumulation whatever the activations' dtype.

Half-precision activations on CUDA are read as they are: the norms accumulate in float32, and
each float32 basis B is split as B_hi + B_lo (two bfloat16 or float16 matrices,
|B - B_hi - B_lo| <= 2^-16 |B|) whose products the matmuls accumulate in float32
(``torch.mm(..., out_dtype=float32)``), so no float32 copy of the activations is made and the
projections keep ~16 bits of the basis. Where a build refuses that call, the float32 fallback
gives the same numbers to ~2^-16.
"""

from __future__ import annotations

import torch

_OUT_DTYPE: dict[tuple, bool] = {}  # (device type, dtype) -> torch.mm(..., out_dtype=float32) works


def split(B: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(d, 2C) [B_hi | B_lo] in ``dtype`` with B_hi + B_lo = B to ~16 bits (B (d, C) float32)."""
    hi = B.to(dtype)
    return torch.cat([hi, (B - hi.float()).to(dtype)], 1)


def has_out_dtype(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether half-precision matmuls with a float32 result work here (CUDA, bf16/fp16, a recent torch)."""
    key = (device.type, dtype)
    if key not in _OUT_DTYPE:
        ok = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
        if ok:
            try:  # the very calls mm and bmm_half make
                a = torch.zeros(2, 2, device=device, dtype=dtype)
                o = torch.empty(2, 2, device=device, dtype=torch.float32)
                torch.mm(a, a, out_dtype=torch.float32, out=o)
                ok = o.dtype == torch.float32 and torch.bmm(a[None], a[None], out_dtype=torch.float32).dtype == o.dtype
            except (RuntimeError, TypeError, NotImplementedError):
                ok = False
        _OUT_DTYPE[key] = ok
    return _OUT_DTYPE[key]


def mm(X: torch.Tensor, B: torch.Tensor, out: torch.Tensor) -> None:
    """out (float32) = X @ B: B is (d, C) float32, or (d, 2C) [B_hi | B_lo] in X's half dtype, whose two
    halves of out the stacked reduction adds (one op for every layer, not one per matmul)."""
    if B.dtype == torch.float32:
        torch.mm(X if X.dtype == torch.float32 else X.float(), B, out=out)
        return
    try:
        torch.mm(X, B, out_dtype=torch.float32, out=out)
    except (RuntimeError, TypeError):  # a layout the half path refuses: float32, the same numbers to ~2^-16
        torch.mm(X.float(), B.float(), out=out)


def bmm_layers(X: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """(L, r, C) float32 = X (L, r, d) @ B (L, d, C): ``mm`` of L layers in one launch (``reduce.batched``,
    on CUDA; a CPU bmm's bits are not its matrices' mms)."""
    if B.dtype == torch.float32:
        return torch.bmm(X if X.dtype == torch.float32 else X.float(), B)
    try:
        return torch.bmm(X, B, out_dtype=torch.float32)
    except (RuntimeError, TypeError):  # as mm: float32, the same numbers to ~2^-16
        return torch.bmm(X.float(), B.float())


def norms(X: torch.Tensor, out: torch.Tensor) -> None:
    """out = ||x|| for each row of X, accumulated in float32 (no float32 copy of a half X)."""
    if X.dtype in (torch.float16, torch.bfloat16, torch.float32):
        torch.linalg.vector_norm(X, dim=-1, dtype=torch.float32, out=out)
    else:  # float64 and others: their float32 values, as every other statistic sees them
        torch.linalg.vector_norm(X.float(), dim=-1, out=out)


def bmm(w: torch.Tensor, X: torch.Tensor, out: torch.Tensor) -> None:
    """out (b, 1, d) float32 = w (b, 1, n) float32 @ X (b, n, d)."""
    torch.bmm(w, X if X.dtype == torch.float32 else X.float(), out=out)


def bmm_half(w: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """(b, 2, d) float32 = [w_hi; w_lo] (b, 2, n) @ X (b, n, d), both in X's half dtype."""
    try:  # no out=: bmm with both out= and out_dtype fell back to the float32 copy on an H200
        return torch.bmm(w, X, out_dtype=torch.float32)
    except (RuntimeError, TypeError):
        return torch.bmm(w.float(), X.float())
