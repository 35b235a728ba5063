"""Fused-qkv layouts of the GPT lineage, checked against numpy readings of the raw state_dict.

Each reader below is written from the model's modeling file (how its forward splits the
fused projection into heads), on plain numpy arrays from ``model.state_dict()``: it shares
no code with eigenhooks' slicers. F = sum_h O_h V_{g(h)}, with O_h the columns of the output
projection that head h's context fills and V_g the value rows of the kv group head h reads.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import transformers as T
from cases.gpt import CASES

import eigenhooks as eh
from eigenhooks.models.base import UnsupportedModelError
from eigenhooks.models.probe import probe_matrices


def _np(sd: dict, key: str) -> np.ndarray:
    return sd[key].detach().double().numpy()


def _F(O: np.ndarray, V: np.ndarray, H: int, group_of) -> np.ndarray:
    """sum_h O[:, head h] @ V[group g(h)]: O (d, H*dh), V (G*dh, d)."""
    dh = O.shape[1] // H
    F = np.zeros((O.shape[0], V.shape[1]))
    for h in range(H):
        g = group_of(h)
        F += O[:, h * dh : (h + 1) * dh] @ V[g * dh : (g + 1) * dh]
    return F


def _rows(W: np.ndarray, idx: list[int]) -> np.ndarray:
    return W[np.array(idx)]


def gpt2(sd, c, i):
    # Conv1D (in, out): value = x @ c_attn[:, 2d:3d]; out = z @ c_proj.
    d = c.n_embd
    Wa, Wp = _np(sd, f"transformer.h.{i}.attn.c_attn.weight"), _np(sd, f"transformer.h.{i}.attn.c_proj.weight")
    return (Wa[:, 2 * d :] @ Wp).T


def per_head(W, O, H):
    """q, k, v interleaved per head: head h's value is rows h*3*dh + 2*dh + j."""
    dh = W.shape[1] // H
    V = _rows(W, [h * 3 * dh + 2 * dh + j for h in range(H) for j in range(dh)])
    return _F(O, V, H, lambda h: h)


def gpt_neox(sd, c, i):
    p = f"gpt_neox.layers.{i}.attention."
    return per_head(_np(sd, p + "query_key_value.weight"), _np(sd, p + "dense.weight"), c.num_attention_heads)


def phi(sd, c, i):
    p = f"model.layers.{i}.self_attn."
    H, G = c.num_attention_heads, c.num_key_value_heads
    return _F(_np(sd, p + "dense.weight"), _np(sd, p + "v_proj.weight"), H, lambda h: h // (H // G))


def falcon(sd, c, i):
    p = f"transformer.h.{i}.self_attention."
    W, O = _np(sd, p + "query_key_value.weight"), _np(sd, p + "dense.weight")
    H, d = c.num_attention_heads, c.hidden_size
    dh = d // H
    if c.new_decoder_architecture:
        # per kv group: H/G queries, one key, one value (modeling_falcon._split_heads)
        G = c.num_kv_heads
        per = H // G + 2
        V = _rows(W, [(g * per + per - 1) * dh + j for g in range(G) for j in range(dh)])
        return _F(O, V, H, lambda h: h // (H // G))
    if c.multi_query:
        # H queries, then one key head, then one value head
        V = W[(H + 1) * dh : (H + 2) * dh]
        return _F(O, V, H, lambda h: 0)
    return per_head(W, O, H)


def gpt_bigcode(sd, c, i):
    p = f"transformer.h.{i}.attn."
    W, O = _np(sd, p + "c_attn.weight"), _np(sd, p + "c_proj.weight")
    H, d = c.n_head, c.n_embd
    dh = d // H
    if c.multi_query:
        # split((d, dh, dh)): q, k, v
        return _F(O, W[d + dh : d + 2 * dh], H, lambda h: 0)
    return per_head(W, O, H)


def bloom(sd, c, i):
    p = f"transformer.h.{i}.self_attention."
    return per_head(_np(sd, p + "query_key_value.weight"), _np(sd, p + "dense.weight"), c.n_head)


def mpt(sd, c, i):
    p = f"transformer.blocks.{i}.attn."
    W, O = _np(sd, p + "Wqkv.weight"), _np(sd, p + "out_proj.weight")
    d = c.d_model
    return _F(O, W[2 * d : 3 * d], c.n_heads, lambda h: h)  # chunk(3): q, k, v


def codegen(sd, c, i):
    # view(..., mp_num, 3*local) then split(local): q, v, k per shard; shards' values concatenate.
    p = f"transformer.h.{i}.attn."
    W, O = _np(sd, p + "qkv_proj.weight"), _np(sd, p + "out_proj.weight")
    d, mp = c.n_embd, 4
    loc = d // mp
    V = _rows(W, [m * 3 * loc + loc + j for m in range(mp) for j in range(loc)])
    return _F(O, V, c.n_head, lambda h: h)


def separate(prefix: str, v: str, o: str, heads: str):
    """Separate (out, in) value and output projections, one kv group per head."""

    def read(sd, c, i):
        p = prefix.format(i=i)
        return _F(_np(sd, p + o), _np(sd, p + v), getattr(c, heads), lambda h: h)

    return read


READERS = {
    "gpt2": gpt2,
    "gpt_neo": separate("transformer.h.{i}.attn.attention.", "v_proj.weight", "out_proj.weight", "num_heads"),
    "gptj": separate("transformer.h.{i}.attn.", "v_proj.weight", "out_proj.weight", "n_head"),
    "opt": separate("model.decoder.layers.{i}.self_attn.", "v_proj.weight", "out_proj.weight", "num_attention_heads"),
    "gpt_neox": gpt_neox,
    "phi": phi,
    "falcon": falcon,
    "gpt_bigcode": gpt_bigcode,
    "bloom": bloom,
    "mpt": mpt,
    "codegen": codegen,
}
NAMES = sorted(n for n, c in CASES.items() if c.family in READERS)


@pytest.mark.parametrize("name", NAMES)
def test_weights_equal_numpy_reading_of_the_state_dict(name):
    model = CASES[name].build()
    ad = eh.get_adapter(model)
    sd, cfg = model.state_dict(), model.config
    for i in range(ad.n_layers):
        ref = READERS[ad.family](sd, cfg, i)
        got = ad.factors(i).matrix().numpy()
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-12 * np.abs(ref).max(), err_msg=f"layer {i}")


def test_the_family_list_covers_every_fused_case():
    """Every gpt.py family that fuses qkv has a numpy reader here (no case slips past the check)."""
    fused = {"gpt2", "gpt_neox", "falcon", "gpt_bigcode", "bloom", "mpt", "codegen"}
    assert fused <= {CASES[n].family for n in NAMES}


# ---- the checks can fail: a wrong slice is caught by the probe and by numpy ----

WRONG = {
    # family -> a plausible misreading: the key rows instead of the value rows
    "falcon (new, grouped kv)": lambda W, H, G, dh: W.view(G, H // G + 2, dh, -1)[:, -2].reshape(G * dh, -1),
    "falcon (multi_query, parallel)": lambda W, H, G, dh: W[H * dh : (H + 1) * dh],
    "gpt_bigcode (mqa)": lambda W, H, G, dh: W[H * dh : (H + 1) * dh],
    "bloom": lambda W, H, G, dh: W.view(H, 3, dh, -1)[:, 1].reshape(H * dh, -1),
    "codegen": lambda W, H, G, dh: W.view(4, 3, W.shape[1] // 4, -1)[:, 2].reshape(W.shape[1], -1),  # k, not v
    "codegen ": lambda W, H, G, dh: W[2 * W.shape[1] :],  # GPT-2's [Q; K; V] reading of CodeGen
}


@pytest.mark.parametrize("name", sorted(WRONG))
def test_a_wrong_slice_is_caught_by_the_probe(name):
    model = CASES[name.strip()].build()
    ad = eh.get_adapter(model)
    H, G = ad.n_heads, ad.n_kv_heads
    dh = ad.d_model // H
    qkv = {"falcon": "query_key_value", "gpt_bigcode": "c_attn", "bloom": "query_key_value", "codegen": "qkv_proj"}
    ly = ad.layers[0]
    W = getattr(ly.attn_in, qkv[ad.family]).weight
    from eigenhooks.linalg.eig import Factors

    F_wrong = Factors.from_stacked(ly.o_proj.weight, WRONG[name](W, H, G, dh), H, G).matrix()
    F_probe = probe_matrices(ad, [0])[0]
    F_right = ad.factors(0).matrix()
    scale = float(F_probe.abs().max())
    assert float((F_right - F_probe).abs().max()) / scale < 1e-5
    assert float((F_wrong - F_probe).abs().max()) / scale > 1e-2


# ---- bloom: the attention adds the residual; the probe reads `dense`, so layers cannot interact ----


def test_bloom_layers_probed_together_equal_probed_apart():
    model = CASES["bloom"].build()
    ad = eh.get_adapter(model)
    assert not ad.probe_separately and all(ly.attn_out is ly.block.self_attention.dense for ly in ad.layers)
    together = probe_matrices(ad)
    apart = probe_matrices(dataclasses.replace(ad, probe_separately=True))
    for i in range(ad.n_layers):
        F_w = ad.factors(i).matrix()
        s = float(F_w.abs().max())
        assert float((together[i] - apart[i]).abs().max()) / s < 1e-6
        assert float((together[i] - F_w).abs().max()) / s < 1e-5


def test_bloom_old_rule_reading_the_attention_module_lets_layer_0_leak_into_layer_1():
    """The old rule read BloomAttention's output (attention + residual). Probed in one forward,
    layer 1's residual is layer 0's probed output, which moves with x: its F came out wrong.
    Probed apart it is right (the residual is then a constant, removed with the bias). In float64,
    so the apart reading's cancellation of the residual is exact to the ~4e-8 that bloom's own
    float32 softmax leaves (its probabilities sum to 1 only to float32 rounding)."""
    model = CASES["bloom"].build().double()
    ad = eh.get_adapter(model)
    old = [dataclasses.replace(ly, attn_out=ly.attn_in) for ly in ad.layers]
    joint = probe_matrices(dataclasses.replace(ad, layers=old))
    apart = probe_matrices(dataclasses.replace(ad, layers=old, probe_separately=True))
    rel = lambda A, i: float((A - ad.factors(i).matrix()).abs().max()) / float(A.abs().max())  # noqa: E731
    assert rel(apart[1], 1) < 1e-6 and rel(joint[0], 0) < 1e-6, (rel(apart[1], 1), rel(joint[0], 0))
    assert rel(joint[1], 1) > 0.1, rel(joint[1], 1)


# ---- mpt clip_qkv: the probe is not linear, verify says so ----


def test_mpt_clip_qkv_probe_is_measurably_nonlinear():
    clipped = {r.layer: r for r in eh.verify(CASES["mpt (clip_qkv)"].build())}
    plain = {r.layer: r for r in eh.verify(CASES["mpt"].build())}
    for i in clipped:
        assert not clipped[i].linear and clipped[i].linearity > 1e-2, clipped[i]
        assert plain[i].linear and plain[i].linearity < 1e-5, plain[i]
    assert any("clip_qkv" in n for n in eh.get_adapter(CASES["mpt (clip_qkv)"].build()).notes)


# ---- clear errors ----


def test_falcon_config_that_cannot_run_is_refused():
    cfg = T.FalconConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        new_decoder_architecture=False,
        parallel_attn=True,
        num_ln_in_parallel_attn=2,
    )
    torch.manual_seed(0)
    model = T.FalconForCausalLM(cfg).eval()
    with pytest.raises(UnsupportedModelError, match=r"falcon layer 0: its forward applies 'input_layernorm'.*ln_attn"):
        eh.get_adapter(model)


def test_bloom_slow_but_exact_is_refused_with_the_fix():
    model = T.BloomForCausalLM(T.BloomConfig(vocab_size=64, hidden_size=16, n_layer=1, n_head=4, pretraining_tp=2))
    model.config.slow_but_exact = True
    for blk in model.transformer.h:
        blk.self_attention.slow_but_exact = True
    with pytest.raises(UnsupportedModelError, match=r"pretraining_tp=2 and slow_but_exact=True.*slow_but_exact=False"):
        eh.get_adapter(model)


def test_codegen_hidden_size_not_divisible_by_mp_num_is_refused():
    cfg = T.CodeGenConfig(vocab_size=64, n_embd=18, n_layer=1, n_head=2, n_inner=32, rotary_dim=2, n_positions=32)
    model = T.CodeGenForCausalLM(cfg)
    with pytest.raises(UnsupportedModelError, match=r"codegen layer 0: .*mp_num=4.*hidden_size=18"):
        eh.get_adapter(model)


@pytest.mark.parametrize("family", ["gpt2", "gpt_bigcode"])
def test_cross_attention_blocks_are_refused(family):
    if family == "gpt2":
        model = T.GPT2LMHeadModel(
            T.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=32, add_cross_attention=True)
        )
    else:
        model = T.GPTBigCodeForCausalLM(
            T.GPTBigCodeConfig(
                n_layer=1,
                n_head=2,
                n_embd=16,
                vocab_size=64,
                n_positions=32,
                multi_query=False,
                add_cross_attention=True,
            )
        )
    with pytest.raises(UnsupportedModelError, match=rf"{family} with add_cross_attention=True.*not covered"):
        eh.get_adapter(model)
