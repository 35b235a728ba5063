"""One read of an activation: its row norms, target projections, null projections and consensus sums.

A layer's hooks need four things from each reading X (b, n, d), in the model's dtype:

- ``norms`` (b*n,): ||x|| of every row, accumulated in float32;
- ``Pt`` (b*n, C): every row projected onto the targets' columns Bt (d, C);
- ``Pn`` (N, Cn): the null subsample's rows (``flat``, from ``reduce.Grid.sub``) projected onto the
  null frames Bn (d, Cn);
- ``sv`` (b, d): each sequence's sum of unit vectors sum_i w_i x_i, w_i = mask_i / ||x_i||.

``fused_read_aten`` is the plain twin: the obvious torch ops, in float32 (the reference, the CPU path
and the fallback wherever Triton is absent). ``fused_read_triton`` makes the same numbers with two
kernels. The first reads each row once from memory and keeps the norm, the target projection and the
consensus contribution from that one pass (the consensus needs the row's norm first, so a row block
reads its own rows a second time, in reverse order, while they are still in cache). The null
projection is a second kernel over the N gathered rows only: the subsample is 1/s of the rows and the
null frames are wide (hundreds of columns), so doing it in the first pass would multiply its work by
s, and ``flat`` may name one row twice (empty slots repeat the last position), which a one-pass
scatter could not write. On half dtypes both kernels multiply on tensor cores by splitting each
float32 basis chunk as B_hi + B_lo in X's dtype (products exact, sums in float32, B kept to ~2^-16, as
``reduce.kernels.split`` does); float32 inputs use ``tl.dot(..., input_precision="ieee")``, never TF32.

Non-finite rows behave as in the twin: the norm of a row holding inf is inf and of one holding NaN is
NaN; w_i x_i is then NaN somewhere (0 * inf, NaN * x), so the sequence's ``sv`` holds NaN, also when
that row is masked (w_i = 0), exactly as ``torch.bmm(w, X)`` gives.

Selection: ``use_triton(X)``. Triton is imported only when a Triton path is taken. On the CPU the
Triton kernels run only under Triton's interpreter (``TRITON_INTERPRET=1`` in the environment when
the kernels are first used; they are built per interpreter setting).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import NamedTuple

import torch

_EPS = 1e-30  # the clamp of a zero norm, as the projection's consensus weights
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class ReadOut(NamedTuple):
    """What one read of X (b, n, d) gives, all float32 on X's device.

    Attributes:
        norms: (b*n,) ||x|| per row.
        Pt: (b*n, C) rows @ Bt.
        Pn: (N, Cn) X.reshape(b*n, d)[flat] @ Bn, or None without Bn.
        sv: (b, d) per-sequence sum of x_i * mask_i / max(||x_i||, 1e-30), or None without consensus.
    """

    norms: torch.Tensor
    Pt: torch.Tensor
    Pn: torch.Tensor | None
    sv: torch.Tensor | None


def triton_available() -> bool:
    """Whether ``import triton`` would work (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def use_triton(X: torch.Tensor) -> bool:
    """Whether ``fused_read`` takes the Triton kernels for X.

    Default: X on CUDA in float32, float16 or bfloat16, with triton importable. The environment
    variable ``EIGENHOOKS_TRITON=0`` turns the kernels off; ``EIGENHOOKS_TRITON=1`` also takes them for
    CPU tensors when Triton's interpreter is on (``TRITON_INTERPRET=1``), as the tests do.
    """
    flag = os.environ.get("EIGENHOOKS_TRITON", "").strip()
    if flag == "0" or X.dtype not in _TRITON_DTYPES or not triton_available():
        return False
    if X.is_cuda:
        return True
    return flag == "1" and X.device.type == "cpu" and _interpreting()


def fused_read(
    X: torch.Tensor,
    mask: torch.Tensor,
    Bt: torch.Tensor,
    Bn: torch.Tensor | None = None,
    flat: torch.Tensor | None = None,
    consensus: bool = True,
) -> ReadOut:
    """Norms, target and null projections and consensus sums of X, by Triton where ``use_triton(X)``.

    Args:
        X: (b, n, d) float32, float16 or bfloat16 (any strides; others are read as float32).
        mask: (b, n) bool, the valid tokens (weights of the consensus sums).
        Bt: (d, C) float32, the targets' columns.
        Bn: (d, Cn) float32, the null frames' columns, or None (no ``Pn``).
        flat: (N,) int64 positions in X.reshape(b*n, d) of the null subsample, or None (every row).
        consensus: whether to make ``sv``.

    Returns:
        a ``ReadOut``.

    Example:
        >>> X = torch.randn(2, 5, 8)
        >>> out = fused_read(X, torch.ones(2, 5, dtype=torch.bool), torch.randn(8, 3))
        >>> out.Pt.shape, out.sv.shape
        (torch.Size([10, 3]), torch.Size([2, 8]))
    """
    _check(X, mask, Bt, Bn, flat)
    if use_triton(X):
        return fused_read_triton(X, mask, Bt, Bn, flat, consensus)
    return fused_read_aten(X, mask, Bt, Bn, flat, consensus)


def _check(X, mask, Bt, Bn, flat) -> None:
    if X.dim() != 3:
        raise ValueError(f"fused_read wants X as (batch, positions, d_model); got {X.shape=}")
    b, n, d = X.shape
    if mask.shape != (b, n) or mask.dtype != torch.bool:
        raise ValueError(f"fused_read wants mask (b, n) = {(b, n)} bool; got {mask.shape=}, {mask.dtype=}")
    for name, B in (("Bt", Bt), ("Bn", Bn)):
        if B is not None and (B.dim() != 2 or B.shape[0] != d or B.dtype != torch.float32):
            raise ValueError(f"fused_read wants {name} as ({d}, columns) float32; got {B.shape=}, {B.dtype=}")
    if flat is not None and (flat.dim() != 1 or flat.dtype != torch.int64):
        raise ValueError(f"fused_read wants flat as (N,) int64 row positions; got {flat.shape=}, {flat.dtype=}")


def fused_read_aten(X, mask, Bt, Bn=None, flat=None, consensus: bool = True) -> ReadOut:
    """The plain twin of ``fused_read_triton``: the same numbers by torch ops, in float32."""
    b, n, d = X.shape
    X2 = X.reshape(b * n, d)
    Xf = X2.float()  # float32 X: no copy; half X: a float32 copy (the plain way)
    if X.dtype in _TRITON_DTYPES:
        norms = torch.linalg.vector_norm(X2, dim=-1, dtype=torch.float32)
    else:  # float64 and others: their float32 values, as every other statistic sees them
        norms = torch.linalg.vector_norm(Xf, dim=-1)
    Pt = Xf @ Bt
    Pn = None
    if Bn is not None:
        Pn = (Xf if flat is None else Xf.index_select(0, flat)) @ Bn
    sv = None
    if consensus:
        w = mask.reshape(b * n) / norms.clamp_min(_EPS)  # 0 on masked rows, NaN where ||x|| is NaN
        sv = torch.bmm(w.view(b, 1, n), Xf.view(b, n, d))[:, 0]  # 0 * inf and 0 * NaN are NaN, as in bmm
    return ReadOut(norms, Pt, Pn, sv)


def fused_read_triton(X, mask, Bt, Bn=None, flat=None, consensus: bool = True) -> ReadOut:
    """``fused_read`` by the Triton kernels (CUDA, or the CPU under ``TRITON_INTERPRET=1``)."""
    if X.dtype not in _TRITON_DTYPES:
        raise ValueError(f"the Triton read takes float32, float16 or bfloat16 activations; got {X.dtype=}")
    k = _kernels(_interpreting())
    b, n, d = X.shape
    C = Bt.shape[1]
    dev = X.device
    norms = torch.empty(b * n, device=dev, dtype=torch.float32)
    Pt = torch.empty(b * n, C, device=dev, dtype=torch.float32)
    BLOCK_R = 16 if n <= 16 else 32
    nblk = -(-n // BLOCK_R)
    fuse_pt = 0 < C <= 128  # a wider Pt would not fit the first kernel's registers: the GEMM kernel makes it
    svp = torch.empty(b, nblk, d, device=dev, dtype=torch.float32) if consensus else norms
    m8 = mask.contiguous().view(torch.uint8)
    tc, half = _tensor_cores(X)
    k.rows[(b, nblk)](
        X, *X.stride(), m8, Bt, *Bt.stride(), norms, Pt, *Pt.stride(), svp, n, d, C,
        BLOCK_R=BLOCK_R, BLOCK_D=64, BLOCK_C=max(16, _next_pow2(C)), TC=tc, HALF=half,
        HAS_PT=fuse_pt, HAS_SV=consensus,
    )  # fmt: skip
    if C and not fuse_pt:
        _gather_mm(k, X, None, Bt, Pt, tc, half)
    Pn = None
    if Bn is not None:
        N = b * n if flat is None else flat.numel()
        Pn = torch.empty(N, Bn.shape[1], device=dev, dtype=torch.float32)
        _gather_mm(k, X, flat, Bn, Pn, tc, half)
    sv = None
    if consensus:  # the row blocks' partial sums, added in a fixed order (no atomics: runs repeat bit for bit)
        sv = svp[:, 0] if nblk == 1 else svp.sum(1)
    return ReadOut(norms, Pt, Pn, sv)


def _gather_mm(k, X, flat, B, out, tc, half) -> None:
    """out (N, cols) = X.reshape(b*n, d)[flat] @ B, the rows read in place (no gathered copy)."""
    b, n, d = X.shape
    N, cols = out.shape
    if N == 0 or cols == 0:
        return
    BR, BC = 32, 64
    grid = (-(-N // BR), -(-cols // BC))
    k.gather_mm[grid](
        X, *X.stride(), flat if flat is not None else out, B, *B.stride(), out, *out.stride(), N, n, d, cols,
        HAS_FLAT=flat is not None, BLOCK_R=BR, BLOCK_D=32, BLOCK_C=BC, TC=tc, HALF=half,
    )  # fmt: skip


def _tensor_cores(X: torch.Tensor):
    """(TC, HALF): split products on tensor cores for half X on a GPU. Triton 3.9's interpreter stores
    bfloat16 as its bits and multiplies those in tl.dot, so there a bfloat16 X is widened to float32
    first and meets the float32 basis in an IEEE dot; float16 takes the split path there as on a GPU,
    which is the code a bfloat16 X takes on a GPU with the dtype changed."""
    import triton.language as tl

    half = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}.get(X.dtype, tl.float32)
    tc = X.dtype == torch.float16 or (X.dtype == torch.bfloat16 and X.is_cuda)
    return tc, half


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


@functools.cache
def _kernels(interpret: bool):
    """The Triton kernels, built on first use (so importing eigenhooks never imports triton), once per
    interpreter setting (Triton decides at decoration whether a kernel is interpreted).

    They call only Triton's builtins: tl.sum, tl.zeros and tl.cdiv are jit'd functions themselves, made
    when triton was first imported, and fail under an interpreter switched on later (as in a test
    process that imported triton before); tl.reduce with tl.sum's own combine works either way and
    compiles to the same reduction."""
    import triton
    import triton.language as tl

    @triton.jit
    def rows(
        X, sxb, sxn, sxd, M, B, sbd, sbc, NORMS, P, spr, spc, SVP, n, d, C,
        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, TC: tl.constexpr,
        HALF: tl.constexpr, HAS_PT: tl.constexpr, HAS_SV: tl.constexpr,
    ):  # fmt: skip
        # one program: BLOCK_R positions of sequence pid_b; loops over d in BLOCK_D chunks
        pid_b = tl.program_id(0)
        pid_r = tl.program_id(1)
        r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        rm = r < n
        xrow = X + pid_b.to(tl.int64) * sxb + r.to(tl.int64) * sxn  # (BLOCK_R,) row starts
        c = tl.arange(0, BLOCK_C)
        cm = c < C
        sq = tl.full((BLOCK_R,), 0.0, tl.float32)
        acc = tl.full((BLOCK_R, BLOCK_C), 0.0, tl.float32)
        for k0 in range(0, d, BLOCK_D):
            j = k0 + tl.arange(0, BLOCK_D)
            jm = j < d
            x = tl.load(xrow[:, None] + j[None, :] * sxd, mask=rm[:, None] & jm[None, :], other=0.0)
            xf = x.to(tl.float32)
            sq += tl.reduce(xf * xf, 1, tl.standard._sum_combine)
            if HAS_PT:
                bb = tl.load(B + j[:, None] * sbd + c[None, :] * sbc, mask=jm[:, None] & cm[None, :], other=0.0)
                if TC:  # B = hi + lo in X's dtype: exact products, float32 sums
                    hi = bb.to(HALF)
                    acc = tl.dot(x, hi, acc)
                    acc = tl.dot(x, (bb - hi.to(tl.float32)).to(HALF), acc)
                else:
                    acc = tl.dot(xf, bb, acc, input_precision="ieee")
        norm = tl.sqrt(sq)
        row = pid_b.to(tl.int64) * n + r
        tl.store(NORMS + row, norm, mask=rm)
        if HAS_PT:
            tl.store(P + row[:, None] * spr + c[None, :] * spc, acc, mask=rm[:, None] & cm[None, :])
        if HAS_SV:
            m = tl.load(M + row, mask=rm, other=0).to(tl.float32)
            w = m / tl.maximum(norm, 1e-30, propagate_nan=tl.PropagateNan.ALL)  # NaN norm: NaN weight
            out = SVP + (pid_b.to(tl.int64) * tl.num_programs(1) + pid_r) * d
            nk = (d + BLOCK_D - 1) // BLOCK_D
            for i in range(0, nk):  # last chunk first: the most recently read is the likeliest cached
                j = (nk - 1 - i) * BLOCK_D + tl.arange(0, BLOCK_D)
                jm = j < d
                x = tl.load(xrow[:, None] + j[None, :] * sxd, mask=rm[:, None] & jm[None, :], other=0.0)
                tl.store(out + j, tl.reduce(x.to(tl.float32) * w[:, None], 0, tl.standard._sum_combine), mask=jm)

    @triton.jit
    def gather_mm(
        X, sxb, sxn, sxd, FLAT, B, sbd, sbc, P, spr, spc, N, n, d, C,
        HAS_FLAT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
        TC: tl.constexpr, HALF: tl.constexpr,
    ):  # fmt: skip
        # one program: BLOCK_R of the N rows by BLOCK_C of the columns; rows read where they lie in X
        i = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        im = i < N
        if HAS_FLAT:
            src = tl.load(FLAT + i, mask=im, other=0)
        else:
            src = i.to(tl.int64)
        xrow = X + (src // n) * sxb + (src % n) * sxn
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cm = c < C
        acc = tl.full((BLOCK_R, BLOCK_C), 0.0, tl.float32)
        for k0 in range(0, d, BLOCK_D):
            j = k0 + tl.arange(0, BLOCK_D)
            jm = j < d
            x = tl.load(xrow[:, None] + j[None, :] * sxd, mask=im[:, None] & jm[None, :], other=0.0)
            bb = tl.load(B + j[:, None] * sbd + c[None, :] * sbc, mask=jm[:, None] & cm[None, :], other=0.0)
            if TC:
                hi = bb.to(HALF)
                acc = tl.dot(x, hi, acc)
                acc = tl.dot(x, (bb - hi.to(tl.float32)).to(HALF), acc)
            else:
                acc = tl.dot(x.to(tl.float32), bb, acc, input_precision="ieee")
        tl.store(P + i.to(tl.int64)[:, None] * spr + c[None, :] * spc, acc, mask=im[:, None] & cm[None, :])

    return _Kernels(rows, gather_mm)


class _Kernels(NamedTuple):
    rows: object
    gather_mm: object
