"""The fused read (``benchmarks/fused_read.py``, out of the package until a GPU measures it): Triton kernels
against the aten twin and float64 numpy.

The Triton kernels run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set per
test), and on CUDA where there is one. Tolerances are relative to the sizes of the summands
(|X| @ |B| for a projection, sum_i |w_i x_i| for a consensus sum), so they hold at any scale:
float32 sums of a few hundred terms stay within 2e-6 of that; the bfloat16 split keeps the basis
to 2^-16, hence 3e-5 where that split runs (CUDA).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

_spec = importlib.util.spec_from_file_location(
    "fused_read", Path(__file__).resolve().parents[2] / "benchmarks" / "fused_read.py"
)
K = importlib.util.module_from_spec(_spec)
sys.modules["fused_read"] = K  # its kernels are looked up by module when Triton builds them
_spec.loader.exec_module(K)

needs_triton = pytest.mark.skipif(
    not K.triton_available(), reason="triton is not installed (pip install 'triton>=3.9': Linux, Python >= 3.11)"
)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (b, n, d, C, Cn): odd widths, one position, a width wider than the first kernel takes (C > 128)
SHAPES = [(3, 37, 100, 5, 40), (2, 1, 48, 3, 17), (1, 70, 129, 16, 8), (2, 5, 33, 130, 3)]


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("EIGENHOOKS_TRITON", "1")


def _inputs(b, n, d, C, Cn, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    X = (torch.randn(b, n, d, generator=g) * 3).to(dtype)
    mask = torch.rand(b, n, generator=g) > 0.25
    mask[:, 0] = True
    Bt = torch.randn(d, C, generator=g) / d**0.5
    Bn = torch.randn(d, Cn, generator=g) / d**0.5
    N = max(1, b * n // 3)
    flat = torch.randint(0, b * n, (N,), generator=g)
    flat[-1] = flat[0]  # a row named twice, as empty subsample slots are
    return [t.to(device) for t in (X, mask, Bt, Bn, flat)]


def _numpy_ref(X, mask, Bt, Bn, flat):
    """float64 numpy: (norms, Pt, Pn, sv) and the magnitudes the tolerances scale with."""
    b, n, d = X.shape
    x = X.double().cpu().numpy().reshape(b * n, d)
    bt, bn, m = Bt.double().cpu().numpy(), Bn.double().cpu().numpy(), mask.cpu().numpy().reshape(b * n)
    norms = np.sqrt((x * x).sum(1))
    with np.errstate(invalid="ignore", divide="ignore"):
        w = m / np.maximum(norms, 1e-30)
    xs = x[flat.cpu().numpy()]
    wx = (w[:, None] * x).reshape(b, n, d)
    ref = (norms, x @ bt, xs @ bn, wx.sum(1))
    size = (np.abs(x) @ np.abs(bt), np.abs(xs) @ np.abs(bn), np.abs(wx).sum(1))
    return ref, size


def _close(got, ref, size, tol, what):
    got = got.double().cpu().numpy()
    err = np.abs(got - ref)
    bad = err > tol * size + 1e-30
    assert not bad.any(), f"{what}: {bad.sum()} entries off, worst {np.max(err / (size + 1e-30)):.3g} of size"


def _check_against_numpy(out, inputs, tol):
    (norms, Pt, Pn, sv), (sPt, sPn, ssv) = _numpy_ref(*inputs)
    np.testing.assert_allclose(out.norms.double().cpu().numpy(), norms, rtol=1e-6)
    _close(out.Pt, Pt, sPt, tol, "Pt")
    _close(out.Pn, Pn, sPn, tol, "Pn")
    _close(out.sv, sv, ssv, tol, "sv")


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_aten_twin_matches_float64(dtype):
    inputs = _inputs(3, 37, 100, 5, 40, dtype)
    _check_against_numpy(K.fused_read_aten(*inputs), inputs, 2e-6)


@needs_triton
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_matches_the_twin_and_float64(interpret, dtype, shape):
    inputs = _inputs(*shape, dtype)
    out = K.fused_read_triton(*inputs)
    twin = K.fused_read_aten(*inputs)
    _check_against_numpy(out, inputs, 2e-6)
    for got, want in zip(out, twin):
        assert got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_triton
def test_triton_reads_strided_activations_without_flat_or_consensus(interpret):
    X, mask, Bt, Bn, _ = _inputs(2, 19, 40, 4, 9, torch.float32)
    Xt = X.transpose(0, 1).contiguous().transpose(0, 1)  # (b, n, d) with the batch stride smallest
    assert not Xt.is_contiguous()
    out = K.fused_read_triton(Xt, mask, Bt, Bn, None, consensus=False)
    assert out.sv is None and out.Pn.shape == (2 * 19, 9)
    twin = K.fused_read_aten(X, mask, Bt, Bn, None, consensus=False)
    for got, want in zip(out[:3], twin[:3]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _poison(X, mask):
    """A valid NaN row in sequence 0, one inf entry in a valid row of sequence 1, a NaN in a masked
    row of sequence 2; sequence 3 stays clean."""
    X[0, 3] = float("nan")
    mask[0, 3] = mask[1, 2] = True
    X[1, 2, 5] = float("inf")
    mask[2, 4] = False
    X[2, 4, 0] = float("nan")
    return X, mask


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nonfinite_rows_as_the_twin(interpret, dtype):
    X, mask, Bt, Bn, flat = _inputs(4, 9, 24, 3, 6, dtype)
    X, mask = _poison(X, mask)
    out, twin = K.fused_read_triton(X, mask, Bt, Bn, flat), K.fused_read_aten(X, mask, Bt, Bn, flat)
    for o in (out, twin):
        assert o.norms[3].isnan() and o.norms[9 + 2] == float("inf")
        assert [bool(o.sv[s].isnan().any()) for s in range(4)] == [True, True, True, False]
    bad = ~torch.isfinite(twin.norms)
    assert bad.sum() == 3
    torch.testing.assert_close(out.norms, twin.norms, rtol=1e-6, atol=0, equal_nan=True)
    assert not torch.isfinite(out.Pt[bad]).all(1).any()  # each non-finite row projects to non-finite
    torch.testing.assert_close(out.Pt[~bad], twin.Pt[~bad], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.sv[3], twin.sv[3], rtol=1e-5, atol=1e-5)
    assert torch.equal(out.sv.isnan(), twin.sv.isnan())  # a NaN norm makes the whole weight NaN, as clamp_min does


@needs_triton
def test_triton_is_deterministic(interpret):
    inputs = _inputs(2, 70, 50, 4, 5, torch.bfloat16)
    a, b = K.fused_read_triton(*inputs), K.fused_read_triton(*inputs)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.skipif(not torch.cuda.is_available() or not K.triton_available(), reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_on_cuda_matches_float64(dtype):
    inputs = _inputs(4, 300, 2048, 6, 260, dtype, device="cuda")
    tol = 3e-5 if dtype == torch.bfloat16 else 2e-6  # bf16: B split in bf16 keeps 2^-16 of it; no TF32 anywhere
    _check_against_numpy(K.fused_read_triton(*inputs), inputs, tol)


def test_use_triton_follows_device_dtype_and_environment(monkeypatch):
    X = torch.zeros(1, 2, 4)
    monkeypatch.delenv("EIGENHOOKS_TRITON", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not K.use_triton(X)  # a CPU tensor, no interpreter
    monkeypatch.setenv("EIGENHOOKS_TRITON", "1")
    assert not K.use_triton(X)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert K.use_triton(X) == K.triton_available()
    assert not K.use_triton(X.double())
    monkeypatch.setenv("EIGENHOOKS_TRITON", "0")
    assert not K.use_triton(X)


def test_fused_read_takes_the_twin_on_the_cpu(monkeypatch):
    monkeypatch.delenv("EIGENHOOKS_TRITON", raising=False)
    monkeypatch.setattr(K, "fused_read_triton", lambda *a, **k: pytest.fail("Triton taken on the CPU"))
    inputs = _inputs(2, 3, 8, 2, 2, torch.float64)
    out = K.fused_read(*inputs)
    _check_against_numpy(out, inputs, 2e-6)  # float64 read as its float32 values


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: a.__setitem__(0, a[0][0]), r"\(batch, positions, d_model\)"),
        (lambda a: a.__setitem__(1, a[1].long()), "mask"),
        (lambda a: a.__setitem__(2, a[2].double()), "Bt as"),
        (lambda a: a.__setitem__(3, a[3][:-1]), "Bn as"),
        (lambda a: a.__setitem__(4, a[4].int()), "flat as"),
    ],
)
def test_wrong_inputs_say_what_was_expected(change, match):
    inputs = _inputs(2, 3, 8, 2, 2, torch.float32)
    change(inputs)
    with pytest.raises(ValueError, match=match):
        K.fused_read(*inputs)
