"""Llama-style decoders checked against what eigenhooks did not compute.

- F rebuilt in numpy from the raw ``state_dict()`` tensors, with the head/group slicing
  written here from the modeling files (Phi-3's fused ``qkv_proj`` rows are [q | k | v];
  ``repeat_kv`` gives query head h the kv group h // (H / G)).
- The scale ``adapter.norm_weight`` reports, against what the norm module really does to a
  zero-mean input (Gemma and Nemotron scale by 1 + weight).
- OLMo's ``clip_qkv``: the probe fails superposition, verify flags it, and spectra come from
  the weights, never from the probe.
- Clear errors where a block does not hold the projections the rule reads.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cases.decoders import CASES
from torch import nn

import eigenhooks as eh
from eigenhooks.models.base import UnsupportedModelError
from eigenhooks.models.hf import hf_adapter
from eigenhooks.models.probe import probe_matrices

NAMES = sorted(CASES)


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def numpy_F(model, i: int) -> np.ndarray:
    """F (d, d) of layer i from the state dict: sum_h O_h V_{g(h)}, float64."""
    cfg = model.config.get_text_config()
    H = cfg.num_attention_heads
    G = getattr(cfg, "num_key_value_heads", None) or H
    dh = _head_dim(cfg)
    sd = {k: v.detach().double().numpy() for k, v in model.state_dict().items()}
    p = next(k for k in sd if k.endswith(f"layers.{i}.self_attn.o_proj.weight"))[: -len("o_proj.weight")]
    O = sd[p + "o_proj.weight"]  # (d, H dh)
    if p + "qkv_proj.weight" in sd:  # Phi-3: out features [q (H dh) | k (G dh) | v (G dh)]
        V = sd[p + "qkv_proj.weight"][(H + G) * dh :]
    else:
        V = sd[p + "v_proj.weight"]  # (G dh, d)
    if p + "attn_sub_norm.weight" in sd:  # BitNet: RMSNorm(heads) then o_proj; its scale multiplies O's columns
        O = O * sd[p + "attn_sub_norm.weight"][None, :]
    assert V.shape == (G * dh, cfg.hidden_size) and O.shape == (cfg.hidden_size, H * dh)
    rep = H // G
    return sum(O[:, h * dh : (h + 1) * dh] @ V[(h // rep) * dh : (h // rep + 1) * dh] for h in range(H))


def _randomise_norms(model, seed: int = 4) -> None:
    """Seeded models start with norm scales at 0 or 1, which would hide a missing or extra scale."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n and p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("name", NAMES)
def test_F_equals_numpy_from_state_dict(name):
    model = CASES[name].build()
    _randomise_norms(model)
    ad = eh.get_adapter(model)
    assert ad.n_layers == model.config.get_text_config().num_hidden_layers
    for i in range(ad.n_layers):
        ref = numpy_F(model, i)
        got = ad.factors(i).matrix().numpy()
        rel = np.abs(got - ref).max() / np.abs(ref).max()
        assert rel < 1e-12, (i, rel)


def _zero_mean_input(d: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, d, generator=g)
    return 1e3 * (x - x.mean(-1, keepdim=True))  # large, so every norm's eps is negligible


@pytest.mark.parametrize("name", NAMES)
def test_norm_weight_is_the_scale_the_norm_applies(name):
    """norm(x) - norm(0) = x_hat * scale for zero-mean x, whether RMSNorm or LayerNorm."""
    model = CASES[name].build()
    _randomise_norms(model)
    ad = eh.get_adapter(model)
    x = _zero_mean_input(ad.d_model)
    x_hat = x / x.pow(2).mean(-1, keepdim=True).sqrt()
    for i, ly in enumerate(ad.layers):
        if ly.norm is None:
            assert name in ("olmo2", "olmo3", "exaone4"), name  # post-only blocks: nothing feeds attention
            continue
        w = ad.norm_weight(i)
        w = torch.ones(ad.d_model) if w is None else w.float()
        with torch.no_grad():
            got = ly.norm(x) - ly.norm(torch.zeros_like(x))
        torch.testing.assert_close(got, x_hat * w, rtol=1e-5, atol=1e-4)


NONLINEAR = {n: c for n, c in CASES.items() if c.nonlinear}


@pytest.mark.parametrize(
    "name, word",
    [
        ("olmo (clip_qkv)", "clip_qkv"),
        ("granite_swa (sinks, nonlinear)", "sink"),
        ("bitnet (sub-norm, nonlinear)", "attn_sub_norm"),
    ],
)
def test_nonlinear_paths_are_flagged_and_spectra_come_from_the_weights(name, word, built):
    model = built(name)
    rows = eh.verify(model)
    assert all(not r.linear for r in rows)
    assert min(r.linearity for r in rows) > 1e-2, [r.linearity for r in rows]  # the probe really is nonlinear
    ad = eh.get_adapter(model)
    assert any(word in n and "nonlinear" in n for n in ad.notes)
    for s in eh.spectra(model, cache=False):
        lam = np.linalg.eigvals(numpy_F(model, s.layer))
        top = lam[np.argmax(np.abs(lam))]
        assert abs(abs(complex(s.eigenvalues[0])) - abs(top)) < 1e-9 * abs(top)


def test_every_nonlinear_case_is_tested_above():
    assert sorted(NONLINEAR) == ["bitnet (sub-norm, nonlinear)", "granite_swa (sinks, nonlinear)", "olmo (clip_qkv)"]


def test_linear_relatives_pass_the_probes_linearity(built):
    assert max(r.linearity for r in eh.verify(built("olmo"))) < 1e-5


@pytest.mark.parametrize(
    "name, where",
    [("llama", "v_proj"), ("gemma2", "o_proj"), ("olmo2", "v_proj"), ("phi3 (fused qkv)", "qkv_proj")],
)
def test_missing_projection_is_a_clear_error(name, where):
    model = CASES[name].build()
    setattr(model.model.layers[1].self_attn, where, nn.Identity())
    with pytest.raises(UnsupportedModelError, match=rf"expected self_attn\..*{where}.*found .*Attention with children"):
        hf_adapter(model)
    with pytest.raises(UnsupportedModelError, match=rf"expected self_attn\..*{where}"):
        eh.get_adapter(model)  # a known family says why; no silent guess by the generic probe


def test_notes_say_what_the_step_is():
    notes = {
        n: eh.get_adapter(CASES[n].build()).notes for n in ("granite (residual x0.5)", "gemma2", "cohere (parallel)")
    }
    assert any("x + 0.5·F x" in s for s in notes["granite (residual x0.5)"])
    assert any("(1 + weight)" in s for s in notes["gemma2"]) and any("sandwich" in s for s in notes["gemma2"])
    assert any("parallel" in s for s in notes["cohere (parallel)"])


QK_NORM = [
    "qwen3",
    "qwen3_moe",
    "olmo2",
    "gemma3 (text)",
    "cohere (parallel)",
    "stablelm (parallel)",
    "hunyuan_v1_dense",
]


@pytest.mark.parametrize("name", QK_NORM)
def test_qk_norms_leave_F_alone(name):
    """With every norm scale randomised (q/k norms included), the forward's F is still O V."""
    model = CASES[name].build()
    _randomise_norms(model, seed=5)
    qk = [
        n
        for n, _ in model.named_parameters()
        if any(k in n for k in ("q_norm", "k_norm", "q_layernorm", "query_layernorm"))
    ]
    assert qk, "no q/k norm found: the case does not test what it says"
    ad = eh.get_adapter(model)
    probed = probe_matrices(ad)
    for i in range(ad.n_layers):
        F = ad.factors(i).matrix()
        assert float((F - probed[i]).abs().max()) <= 1e-5 * float(F.abs().max()), i
