"""The linear F stated for the nonlinear value paths (sinks, MLA, gated attention) against the model's own map."""

import torch
from cases import CASES

import eigenhooks as eh
from eigenhooks.models.probe import apply_attention, probe_matrices


def test_gpt_oss_F_is_the_probe_with_sinks_at_minus_infinity():
    model = CASES["gpt_oss (sinks)"].build()
    ad = eh.get_adapter(model)
    with_sinks = probe_matrices(ad)
    for ly in ad.layers:
        ly.block.self_attn.sinks.data.fill_(-1e4)  # exp(-1e4) = 0 in float32: no sink mass
    without = probe_matrices(ad)
    for i in range(ad.n_layers):
        F = ad.factors(i).matrix()
        scale = float(F.abs().max())
        assert float((F - without[i]).abs().max()) / scale < 1e-5
        assert float((F - with_sinks[i]).abs().max()) / scale > 1e-3  # the sinks really change the map


def _attention_modules(model):
    return [ly.attn_out for ly in eh.get_adapter(model).layers]


def test_deepseek_mla_F_is_the_probe_without_the_latent_rms():
    """MLA: the model's own identical-token output is F x / rms(W_kv_a,latent x), F as stated.

    Read from the raw weights here (value rows of kv_b_proj per head, the latent rows of
    kv_a_proj_with_mqa, the latent norm's weight), not from the adapter's factors.
    """
    model = CASES["deepseek_v3 (MLA)"].build()  # float32: the MoE grouped matmul has no float64
    cfg = model.config
    assert not cfg.attention_bias  # with biases the output has a constant term; the case has none
    ad = eh.get_adapter(model)
    H, r, dn, dv = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
    X = torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for i, ly in enumerate(ad.layers):
        a = ly.block.self_attn
        sd = {k: v.detach().double() for k, v in a.state_dict().items()}
        Wa = sd["kv_a_proj_with_mqa.weight"][:r]  # (r, d): the latent
        Wv = sd["kv_b_proj.weight"].reshape(H, dn + dv, r)[:, dn:]  # (H, dv, r): the value rows
        g, O = sd["kv_a_layernorm.weight"], sd["o_proj.weight"]
        z = X @ Wa.T  # (m, r)
        rms = torch.sqrt(z.pow(2).mean(-1, keepdim=True) + a.kv_a_layernorm.variance_epsilon)
        expected = torch.einsum("hvr,mr->mhv", Wv, (z * g) / rms).reshape(len(X), H * dv) @ O.T
        got = apply_attention(ad, i, X)
        assert float((got - expected).abs().max()) / float(expected.abs().max()) < 1e-5
        F = ad.factors(i).matrix()  # the adapter's stated F: the same map without the rms division
        assert float((X @ F.T / rms - expected).abs().max()) / float(expected.abs().max()) < 1e-5
        wrong = torch.einsum("hvr,mr->mhv", sd["kv_b_proj.weight"].reshape(H, dn + dv, r)[:, :dv], (z * g) / rms)
        assert float((wrong.reshape(len(X), -1) @ O.T - got).abs().max()) > 1e-3  # the key rows would not do


def test_qwen3_next_F_is_the_probe_with_the_gate_open():
    """qwen3_next's gated attention: the model's own output is O (sigmoid(W_gate x) * V x); F = O V."""
    model = CASES["qwen3_next (hybrid, gated)"].build()  # float32: the MoE grouped matmul has no float64
    cfg = model.config
    ad = eh.get_adapter(model)
    H, G, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    X = torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for i, ly in enumerate(ad.layers):
        a = ly.block.self_attn
        sd = {k: v.detach().double() for k, v in a.state_dict().items()}
        assert not any(k.endswith("bias") for k in sd), "the case has no biases"
        Wg = sd["q_proj.weight"].reshape(H, 2 * hd, -1)[:, hd:].reshape(H * hd, -1)  # each head's second half
        V = sd["v_proj.weight"].reshape(G, hd, -1).repeat_interleave(H // G, 0).reshape(H * hd, -1)
        O = sd["o_proj.weight"]
        expected = (torch.sigmoid(X @ Wg.T) * (X @ V.T)) @ O.T
        got = apply_attention(ad, i, X)
        assert float((got - expected).abs().max()) / float(expected.abs().max()) < 1e-5
        F = ad.factors(i).matrix()
        assert float((F - O @ V).abs().max()) / float(F.abs().max()) < 1e-12  # stated F: the gate open
        assert float((X @ F.T - got).abs().max()) > 1e-3  # and the gate really closes part of it
