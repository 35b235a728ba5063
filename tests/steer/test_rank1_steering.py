"""Rank-1 steering: exact eigenvector, sign, edit == hook, bit-exact restore, re-entry, errors."""

import math

import pytest
import torch
from harness import build
from typer.testing import CliRunner

import eigenhooks as eh
from eigenhooks.cli import app
from eigenhooks.models.probe import probe_matrices
from eigenhooks.steer import rank1
from eigenhooks.steer.edit import mean_abs_cos

PROMPTS = [
    "The capital of France is",
    "I flew from New York to",
    "My favourite city in Europe is",
    "The weather today is",
    "She opened the door and saw",
    "The Eiffel Tower is located in",
    "def add(a, b):\n    return",
    "The best way to learn music is",
    "He bought a ticket to",
    "Once upon a time, there was a",
]


def _hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _unit(d, seed):
    u = torch.randn(d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return u / u.norm()


def _probed_spectrum(model, layer, d):
    """The steered layer's spectrum from the model's own forward (identical-token probe)."""
    F = probe_matrices(eh.get_adapter(model), [layer])[layer]
    return eh.layer_spectrum(eh.Factors(F[None], torch.eye(d, dtype=F.dtype)[None], torch.zeros(1, dtype=torch.long)))


@pytest.fixture(scope="module")
def gpt2():
    return eh.zoo.load("gpt2-tiny")


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral"])
def test_exact_makes_u_an_eigenvector_through_the_forward(family):
    """F' u = lambda u, checked on F' probed from the edited model (GPT-2 Conv1D, GQA)."""
    model = build(family, dtype=torch.float64, std=0.2)
    u = _unit(16, 1)
    for gap in (0.1, 0.5):
        with eh.steer(model, u, gap_ratio=gap, signed=False) as s:
            spec = _probed_spectrum(model, s.layer, 16)
            F_u = probe_matrices(eh.get_adapter(model), [s.layer])[s.layer] @ u
        torch.testing.assert_close(F_u, s.change.lam * u, atol=1e-9 * abs(s.change.lam), rtol=0)
        assert abs(float((spec.basis.T @ u).norm()) - 1) < 1e-9
        assert abs(spec.gap_ratio - gap) < 1e-9 and abs(s.summary().gap_ratio - gap) < 1e-9


def test_quotient_eigenvalues_match_numpy():
    """The eigenvalues other than lambda do not depend on lambda: checked against numpy.linalg.eig."""
    import numpy as np

    model = build("llama", dtype=torch.float64, std=0.2)
    f = eh.get_adapter(model).factors(1)
    u = _unit(16, 2)
    b = rank1.free_vector(rank1.value_stack(f) @ u)
    mu = rank1.quotient_eigenvalues(f, u, b)
    for lam in (50.0, -7.0):
        F2 = rank1.steered_factors(f, rank1.exact(f, u, b, lam)).matrix().numpy()
        ev = np.linalg.eigvals(F2)
        ev = np.delete(ev, np.argmin(np.abs(ev - lam)))
        np.testing.assert_allclose(np.sort_complex(ev), np.sort_complex(mu.numpy()), atol=1e-9)


def test_paper_method_is_approximate_and_symmetric():
    model = build("llama", dtype=torch.float64, std=0.2)
    u = _unit(16, 1)
    with eh.steer(model, u, gap_ratio=0.1, method="paper") as s:
        cos = s.summary().cos_v1_u
    assert 0.9 < cos < 0.9999  # principal, but not exactly u: the exact method is needed for that
    outs = []
    for v in (u, -u):  # u wᵀ is the same matrix for -u: the paper cannot tell them apart
        outs.append(rank1.paper(eh.get_adapter(model).factors(1), v, 3.0).matrix())
    torch.testing.assert_close(outs[0], outs[1])


def test_signed_readout_pushes_calibration_tokens_toward_plus_u(gpt2):
    model, tok = gpt2
    u = eh.direction.token(model, tok, " return")
    batch = tok(["def f(x):\n    y = x + 1\n    return y", "class A:\n    pass"], return_tensors="pt", padding=True)
    with eh.steer(model, u, gap_ratio=0.1, calibration=batch) as s:
        assert s.change.signed and s.calibration_positive > 0.9
        b = s.change.b
    # the constraint that keeps u an eigenvector
    f = eh.get_adapter(model).factors(s.layer)
    assert abs(float(b @ (rank1.value_stack(f) @ u)) - 1) < 1e-12
    with eh.steer(model, u, gap_ratio=0.1, signed=False) as s0:
        assert s0.calibration_positive is None and not torch.allclose(s0.change.b, b)


def test_default_raises_the_token_on_zoo_gpt2(gpt2):
    """The defaults (exact, signed from the model's own samples, gap 0.1) raise p(' return');
    the unsigned and paper constructions lower it here (the issue's complaint)."""
    model, tok = gpt2
    u = eh.direction.token(model, tok, " return")
    t = eh.direction.token_id(tok, " return")
    prompts = ["def f(x):\n    y = x + 1\n   ", "if x > 0:\n       ", "def g(a, b):\n    c = a * b\n   "]

    @torch.no_grad()
    def probs():
        return torch.tensor(
            [float(torch.softmax(model(**tok(p, return_tensors="pt")).logits[0, -1], -1)[t]) for p in prompts]
        )

    plain = probs()
    got = {}
    for name, kw in {"default": {}, "unsigned": {"signed": False}, "paper": {"method": "paper"}}.items():
        with eh.steer(model, u, **kw):
            got[name] = probs()
    assert (got["default"] > plain).all()
    assert (got["unsigned"] < plain).any() and (got["paper"] < plain).any()


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize("method", ["exact", "paper"])
def test_edit_and_hook_agree_and_restore_bit_exactly(family, method):
    model = build(family, dtype=torch.float32, std=0.2)
    ids = torch.randint(0, 64, (2, 6))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    n_hooks = _hooks(model)
    u = torch.zeros(16, dtype=torch.float64)
    u[3] = 1.0
    outs = {}
    for mode in ("edit", "hook"):
        with eh.steer(model, u, alpha=3.0, mode=mode, method=method), torch.no_grad():
            outs[mode] = model(input_ids=ids).logits
    torch.testing.assert_close(outs["edit"], outs["hook"], atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    assert (plain - outs["edit"]).abs().max() > 1e-3  # steering did something
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before) and _hooks(model) == n_hooks


def test_restored_after_exception():
    model = build("gpt2", dtype=torch.float32)
    W = model.transformer.h[1].attn.c_proj.weight.detach().clone()
    with pytest.raises(RuntimeError, match="inside"):
        with eh.steer(model, _unit(16, 0), alpha=5.0):
            assert not torch.equal(model.transformer.h[1].attn.c_proj.weight, W)
            raise RuntimeError("inside")
    assert torch.equal(model.transformer.h[1].attn.c_proj.weight, W)


def test_entering_twice_is_refused_and_leaves_no_edit():
    model = build("llama", dtype=torch.float32)
    W = model.model.layers[1].self_attn.o_proj.weight
    W0 = W.detach().clone()
    s = eh.steer(model, _unit(16, 0), alpha=2.0)
    with s:
        edited = W.detach().clone()
        with pytest.raises(RuntimeError, match="already active"):
            with s:
                pass
        assert torch.equal(W, edited)  # the refused entry changed nothing, undid nothing
        other = eh.steer(model, _unit(16, 1), alpha=2.0)
        with pytest.raises(RuntimeError, match="already edited by another active Steer"):
            other.__enter__()
        with eh.steer(model, _unit(16, 1), alpha=2.0, mode="hook"):  # hooks stack
            pass
    assert torch.equal(W, W0)
    with s:  # sequential reuse works
        assert torch.equal(W, edited)
    assert torch.equal(W, W0) and _hooks(model) == 0


def test_bad_arguments_say_what_to_do():
    model = build("gpt2", dtype=torch.float32)
    e0 = torch.eye(16, dtype=torch.float64)[0]
    with pytest.raises(ValueError, match="zero vector"):
        eh.steer(model, torch.zeros(16), alpha=1.0)
    with pytest.raises(ValueError, match="width d=16"):
        eh.steer(model, torch.ones(8) / 8**0.5, alpha=1.0)
    with pytest.raises(ValueError, match="unit vector"):
        eh.steer(model, torch.ones(16), alpha=1.0)
    with pytest.raises(ValueError, match="non-finite"):
        eh.steer(model, torch.full((16,), float("nan")), alpha=1.0)
    with pytest.raises(ValueError, match="exactly one of alpha and gap_ratio"):
        eh.steer(model, e0, alpha=1.0, gap_ratio=0.1)
    with pytest.raises(ValueError, match="alpha must be a finite number"):
        eh.steer(model, e0, alpha=math.nan)
    with pytest.raises(ValueError, match=r"gap_ratio must be in \(0, 1\)"):
        eh.steer(model, e0, gap_ratio=1.5)
    with pytest.raises(ValueError, match="method must be one of"):
        eh.steer(model, e0, method="magic")
    with pytest.raises(ValueError, match="mode must be one of"):
        eh.steer(model, e0, mode="graft")
    with pytest.raises(ValueError, match="symmetric in ±u"):
        eh.steer(model, e0, method="paper", signed=True)
    with pytest.raises(ValueError, match="calibration must be token ids"):
        eh.steer(model, e0, calibration=torch.zeros(2, 3))
    with pytest.raises(IndexError, match="out of range"):
        eh.steer(model, e0, layer=5)
    attn = model.transformer.h[1].attn
    with torch.no_grad():
        attn.c_attn.weight[0, 32:48] = 0.0  # row 0 of V^T: V e_0 = 0
    with pytest.raises(ValueError, match="V u is ~0"):
        eh.steer(model, e0, layer=1, alpha=1.0)
    albert = build("albert", dtype=torch.float32)
    with pytest.raises(ValueError, match="shares its weights"):
        eh.steer(albert, torch.eye(16)[0], layer=0, alpha=1.0)
    with eh.steer(albert, torch.eye(16)[0], layer=0, alpha=1.0, allow_shared=True) as s:
        assert s.shared_with == [0, 1]


def test_free_vector_errors():
    Vu = torch.tensor([1.0, 0.0], dtype=torch.float64)
    with pytest.raises(ValueError, match="points along -V u"):
        rank1.free_vector(Vu, -Vu)
    with pytest.raises(ValueError, match="mean head output is zero"):
        rank1.free_vector(Vu, torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="any lambda gives gap ratio 0"):
        rank1.lambda_for_gap(torch.zeros(3, dtype=torch.complex128), 0.1)


def test_direction_token_and_contrast(gpt2):
    model, tok = gpt2
    u = eh.direction.token(model, tok, " return")
    W = eh.direction.scaled_unembedding(model)
    t = eh.direction.token_id(tok, " return")
    p = torch.softmax(W @ (u.float() * 128**0.5), -1)
    assert int(p.argmax()) == t and abs(float(u.norm()) - 1) < 1e-12
    raw = eh.direction.token(model, tok, " return", objective="logit")
    torch.testing.assert_close(raw, (W[t] / W[t].norm()).double())
    with pytest.raises(ValueError, match="objective must be one of"):
        eh.direction.token(model, tok, " return", objective="fancy")
    with pytest.raises(ValueError, match="encodes to no token"):
        eh.direction.token(model, tok, "")
    bare = build("gpt2", bare=True, dtype=torch.float32)
    with pytest.raises(ValueError, match="load the model with its LM head"):
        eh.direction.scaled_unembedding(bare)
    c = eh.direction.contrast(model, tok, ["def f(x):", "class A:"], ["The for statement", "An expression"], layer=2)
    assert abs(float(c.norm()) - 1) < 1e-12 and c.shape == (128,)
    assert mean_abs_cos(torch.randn(3, 128), c) < 1


def test_lm_head_random_detection(gpt2):
    assert not eh.direction.lm_head_looks_random(gpt2[0])
    assert eh.direction.lm_head_looks_random(build("llama", dtype=torch.float32))
    fresh = build("gpt2", dtype=torch.float32)
    fresh.init_weights()  # the library's own initialisation, as a checkpoint without a head gets
    assert eh.direction.lm_head_looks_random(fresh)


runner = CliRunner()


def test_cli_steer_top_k_and_errors():
    r = runner.invoke(app, ["steer", "--toward", " return", "--top-k", "3"])
    assert r.exit_code == 0, r.output
    assert "cos(v1', u) 1.0000" in r.output and "before" in r.output and "p(' return')" in r.output
    for bad in ("0", "100000"):
        r = runner.invoke(app, ["steer", "--toward", " return", "--top-k", bad])
        assert r.exit_code == 1 and "--top-k must be in [1," in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["steer", "--toward", " return", "--alpha", "nan"])
    assert r.exit_code == 1 and "alpha must be a finite number" in r.output and "weights" not in r.output
    r = runner.invoke(app, ["steer", "albert-tiny", "--toward", " return", "--alpha", "1"])
    assert r.exit_code == 1 and "shares its weights" in r.output and "Traceback" not in r.output


# ---- real weights: SmolLM2-135M-Instruct ----


@pytest.mark.real
def test_real_exact_eigenvector_and_bit_identical_weights(smollm2):
    """cos(v1', u) from eh.spectra (cache off) on the edited model, 10 random u; weights bit-identical after."""
    model, _ = smollm2
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cos = []
    for seed in range(10):
        u = _unit(576, seed)
        with eh.steer(model, u, gap_ratio=0.1) as s:
            spec = eh.spectra(model, layers=[-1], cache=False)[0]
        cos.append(float((spec.basis.T @ u).norm()))
        assert abs(spec.gap_ratio - 0.1) < 1e-4 and spec.k == 1 and s.summary().cos_v1_u >= 0.9999
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # kept by pytest, shown with -rP or on a failure (not on every -q run)
    print(f"\n[steer smollm2, 10 random u, gap 0.1] min cos(v1', u) = {min(cos):.12f}")
    assert min(cos) >= 0.9999


@pytest.mark.real
@pytest.mark.parametrize("word", [" Paris", " London", " Tokyo"])
def test_real_steering_raises_the_token_on_most_prompts(smollm2, word):
    model, tok = smollm2
    u = eh.direction.token(model, tok, word)
    t = eh.direction.token_id(tok, word)

    @torch.no_grad()
    def probs():
        return torch.tensor(
            [float(torch.softmax(model(**tok(p, return_tensors="pt")).logits[0, -1].double(), -1)[t]) for p in PROMPTS]
        )

    plain = probs()
    with eh.steer(model, u):  # the defaults: exact, signed, gap ratio 0.1, last layer
        steered = probs()
    raised = int((steered > plain).sum())
    # kept by pytest, shown with -rP or on a failure (not on every -q run)
    print(f"\n[steer smollm2 {word!r}] raised on {raised}/10; median p {plain.median():.2e} -> {steered.median():.2e}")
    assert raised >= 8
