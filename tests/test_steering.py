"""Rank-1 steering: the steered spectrum, edit == hook, bit-exact restore, clear errors."""

import pytest
import torch
from conftest import build

import eigenhooks as eh
from eigenhooks.models.probe import probe_matrices
from eigenhooks.steering import mean_abs_cos


def _hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.fixture(scope="module")
def gpt2():
    return eh.zoo.load("gpt2-tiny")


def _tiny_llama():
    m = build("llama", dtype=torch.float32, std=0.2)
    return m, torch.randint(0, 64, (2, 6))


def test_gap_ratio_makes_u_principal_zoo_gpt2(gpt2, capsys):
    model, tok = gpt2
    u = eh.direction.token(model, tok, " return")
    batch = tok(["def f(x):\n    y = x + 1\n   "], return_tensors="pt")
    with eh.steer(model, u, gap_ratio=0.1) as s:
        with torch.no_grad():
            model(**batch)
        rep = s.report(target_token=tok(" return", add_special_tokens=False)["input_ids"][0])
    assert abs(rep.gap_ratio - 0.1) < 1e-3 and rep.cos_v1_u > 0.99
    assert rep.alignment_after > rep.alignment_before  # measured both ways in the same report
    with capsys.disabled():
        print(
            f"\n[steer gpt2-tiny, ' return', gap 0.1] alpha {rep.alpha:.2f}; final residual |cos| with u "
            f"{rep.alignment_before:.3f} -> {rep.alignment_after:.3f}; p(' return') {rep.prob_before:.2e} -> {rep.prob_after:.2e}"
        )


def test_gap_ratio_on_tiny_llama_gqa(capsys):
    """GQA: the solver reaches the gap; cos(v_1', u) -> 1 as the gap ratio -> 0.

    At gap ratio 0.1 this seeded tiny Llama gives cos 0.984, short of the 0.99 the issue
    hoped for: F u has a component off u that a 10:1 gap does not drown. Measured, not hidden.
    """
    model, ids = _tiny_llama()
    g = torch.Generator().manual_seed(1)
    u = torch.randn(16, generator=g, dtype=torch.float64)
    u = u / u.norm()
    cos = {}
    for gap in (0.1, 0.03, 0.01):
        with eh.steer(model, u, layer=-1, gap_ratio=gap) as s:
            rep = s.report()
            # the same claim through the model's own forward: F' from the probe of the edited model
            F = probe_matrices(eh.get_adapter(model), [1])[1]
            spec = eh.layer_spectrum(
                eh.Factors(F[None], torch.eye(16, dtype=F.dtype)[None], torch.zeros(1, dtype=torch.long))
            )
        assert abs(rep.gap_ratio - gap) < 1e-3 * gap / 0.1
        assert abs(float((spec.basis.T @ u).norm()) - rep.cos_v1_u) < 1e-4
        cos[gap] = rep.cos_v1_u
    assert cos[0.1] < cos[0.03] < cos[0.01] and cos[0.01] > 0.99
    with capsys.disabled():
        print(f"\n[steer tiny llama GQA] cos(v1', u) by gap ratio: {cos}")


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_edit_and_hook_agree_and_restore_bit_exactly(family):
    model = build(family, dtype=torch.float32, std=0.2)
    ids = torch.randint(0, 64, (2, 6))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    n_hooks = _hooks(model)
    u = torch.zeros(16, dtype=torch.float64)
    u[3] = 1.0
    outs = {}
    for mode in ("edit", "hook"):
        with eh.steer(model, u, alpha=3.0, mode=mode), torch.no_grad():
            outs[mode] = model(input_ids=ids).logits
    torch.testing.assert_close(outs["edit"], outs["hook"], atol=1e-5, rtol=0)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    assert (plain - outs["edit"]).abs().max() > 1e-3  # steering did something
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before) and _hooks(model) == n_hooks


def test_restored_after_exception():
    model = build("gpt2", dtype=torch.float32)
    W = model.transformer.h[1].attn.c_proj.weight.detach().clone()
    u = torch.zeros(16, dtype=torch.float64)
    u[0] = 1
    with pytest.raises(RuntimeError, match="inside"):
        with eh.steer(model, u, alpha=5.0):
            assert not torch.equal(model.transformer.h[1].attn.c_proj.weight, W)
            raise RuntimeError("inside")
    assert torch.equal(model.transformer.h[1].attn.c_proj.weight, W)


def test_bad_directions_and_shared_layers():
    model = build("gpt2", dtype=torch.float32)
    with pytest.raises(ValueError, match="zero vector"):
        eh.steer(model, torch.zeros(16), alpha=1.0)
    with pytest.raises(ValueError, match="width d=16"):
        eh.steer(model, torch.ones(8) / 8**0.5, alpha=1.0)
    with pytest.raises(ValueError, match="unit vector"):
        eh.steer(model, torch.ones(16), alpha=1.0)
    with pytest.raises(ValueError, match="exactly one of alpha and gap_ratio"):
        eh.steer(model, torch.eye(16)[0], alpha=1.0, gap_ratio=0.1)
    # V u = 0: a u in the null space of every head's value projection
    attn = model.transformer.h[1].attn
    with torch.no_grad():
        attn.c_attn.weight[0, 32:48] = 0.0  # row 0 of V^T: V e_0 = 0
    with pytest.raises(ValueError, match="V u is ~0"):
        eh.steer(model, torch.eye(16, dtype=torch.float64)[0], layer=1, alpha=1.0)
    albert = build("albert", dtype=torch.float32)
    with pytest.raises(ValueError, match="shares its weights"):
        eh.steer(albert, torch.eye(16)[0], layer=0, alpha=1.0)
    with eh.steer(albert, torch.eye(16)[0], layer=0, alpha=1.0, allow_shared=True) as s:
        assert s.shared_with == [0, 1]


def test_contrast_direction_is_unit(gpt2):
    model, tok = gpt2
    u = eh.direction.contrast(model, tok, ["def f(x):", "class A:"], ["The for statement", "An expression"], layer=2)
    assert abs(float(u.norm()) - 1) < 1e-12 and u.shape == (128,)
    assert mean_abs_cos(torch.randn(3, 128), u) < 1
