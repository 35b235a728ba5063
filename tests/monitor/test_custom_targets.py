"""Custom targets of every dtype: a complex vector is the real subspace span(Re v, Im v), as the
monitor's own complex targets are; low-precision unit vectors are checked at their own precision."""

from __future__ import annotations

import math

import pytest
import torch

import eigenhooks as eh

TEXTS = ["def f(x):\n    return x + 1", "class A:\n    pass", "for i in range(10): print(i)"]
SAME = ("gamma_pre", "gamma_mid", "gamma_post", "rho", "rho_ci_lo", "rho_ci_hi", "null_rho_lo", "null_rho_hi")
SAME += ("p_null", "rho_percentile", "fnull_percentile", "consensus_pre")
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.fixture(scope="module")
def gpt2():
    return eh.zoo.load("gpt2-tiny")


def _summary(model, tok, targets):
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    with eh.monitor(model, targets=targets, null_draws=16, fnull_draws=8) as mon, torch.no_grad():
        model(**batch)
    return mon.summary()


def _rows(df, name):
    return df[df.target == name].set_index("layer")


def _assert_same(a, b, cols=SAME, atol=1e-6):
    assert list(a.index) == list(b.index)
    assert (a["k"] == b["k"]).all(), (a["k"], b["k"])
    for c in cols:
        diff = (a[c] - b[c]).abs()
        both_nan = a[c].isna() & b[c].isna()
        assert ((diff <= atol) | both_nan).all(), (c, a[c].tolist(), b[c].tolist())


def _unit(d, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(d, generator=g, dtype=torch.float64)
    return u / u.norm()


def test_complex_v1_as_a_custom_target_gives_the_builtin_statistics(gpt2):
    model, tok = gpt2
    specs = eh.spectra(model)
    assert {s.kind for s in specs} >= {"complex-dominant", "real-dominant"}  # both kinds are covered
    per = {s.layer: s.v_1 for s in specs}  # complex128, unit, as eh.spectra returns it
    assert all(v.is_complex() for v in per.values())
    df = _summary(model, tok, [("ov", "modulus"), ("v1", per)])
    built, mine = _rows(df, "ov/modulus"), _rows(df, "v1")
    assert mine["k"].tolist() == [s.k for s in specs]
    _assert_same(built, mine)
    real = [s.layer for s in specs if s.k == 1]
    _assert_same(built.loc[real], mine.loc[real], cols=("cos_pre", "cos_mid", "cos_post"))


def test_a_shared_complex_vector_is_the_plane_of_its_real_and_imaginary_parts(gpt2):
    model, tok = gpt2
    d = model.config.n_embd
    re, im = _unit(d, 1), _unit(d, 2)
    v = torch.complex(re, im)
    v = v / torch.linalg.vector_norm(v)
    plane = torch.linalg.qr(torch.stack([v.real, v.imag], 1))[0]
    df = _summary(model, tok, [("c", v.to(torch.complex64)), ("plane", plane)])
    assert (_rows(df, "c")["k"] == 2).all()
    _assert_same(_rows(df, "plane"), _rows(df, "c"))


@pytest.mark.parametrize("theta", [0.0, 0.7, -2.5])
def test_a_real_vector_given_as_complex_stays_one_direction(gpt2, theta):
    """e^{i theta} u spans the line of u: k = 1, with the sign of its real part (of u for theta = 0)."""
    model, tok = gpt2
    u = _unit(model.config.n_embd, 3)
    v = u.to(torch.complex128) * complex(math.cos(theta), math.sin(theta))
    df = _summary(model, tok, [("u", u if math.cos(theta) > 0 else -u), ("v", v)])
    assert (_rows(df, "v")["k"] == 1).all()
    _assert_same(_rows(df, "u"), _rows(df, "v"), cols=SAME + ("cos_pre", "cos_mid"))


@pytest.mark.parametrize("dtype", DTYPES + [torch.complex64, torch.complex128], ids=str)
@pytest.mark.parametrize("per_layer", [False, True], ids=["shared", "per-layer"])
def test_unit_vectors_of_every_dtype_are_accepted_and_measured_as_their_unit_line(gpt2, dtype, per_layer):
    model, tok = gpt2
    d = model.config.n_embd
    u = _unit(d, 4)
    if dtype.is_complex:
        u = torch.complex(u, _unit(d, 5))
        u = u / torch.linalg.vector_norm(u)
    given = u.to(dtype)
    exact = given.to(torch.complex128 if dtype.is_complex else torch.float64)
    exact = exact / torch.linalg.vector_norm(exact)  # the line (plane) it spans, exactly unit
    wrap = (lambda x: {i: x for i in range(4)}) if per_layer else (lambda x: x)
    df = _summary(model, tok, [("given", wrap(given)), ("exact", wrap(exact))])
    _assert_same(_rows(df, "exact"), _rows(df, "given"), atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_low_precision_orthonormal_bases_are_accepted(gpt2, dtype):
    model, _ = gpt2
    d = model.config.n_embd
    Q = torch.linalg.qr(torch.randn(d, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(6)))[0]
    mon = eh.monitor(model, targets=[("q", Q.to(dtype)), ("qs", {1: Q.to(dtype), 2: Q[:, :2].to(dtype)})])
    assert len(mon.target_defs) == 2


@pytest.mark.parametrize("dtype", DTYPES + [torch.complex64, torch.complex128], ids=str)
@pytest.mark.parametrize("per_layer", [False, True], ids=["shared", "per-layer"])
def test_vectors_off_unit_beyond_their_precision_are_refused(gpt2, dtype, per_layer):
    model, _ = gpt2
    d = model.config.n_embd
    u = _unit(d, 7)
    if dtype.is_complex:
        u = torch.complex(u, _unit(d, 8)) / math.sqrt(2)
    bad = (u * 1.05).to(dtype)  # 10% off in |u|^2: far beyond the rounding of any of these dtypes
    target = {2: bad} if per_layer else bad
    with pytest.raises(eh.TargetError, match=r"target 'p' is not orthonormal .*tolerance .*divide it by its norm"):
        eh.monitor(model, targets=[("p", target)])


def test_a_non_orthogonal_complex_basis_is_refused_with_the_qr_hint(gpt2):
    model, _ = gpt2
    d = model.config.n_embd
    u = torch.complex(_unit(d, 9), _unit(d, 10)) / math.sqrt(2)
    with pytest.raises(eh.TargetError, match=r"not orthonormal.*torch.linalg.qr"):
        eh.monitor(model, targets=[("p", torch.stack([u, u], 1))])
