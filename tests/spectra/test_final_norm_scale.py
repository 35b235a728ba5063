"""The final norm's effective scale, folded into the unembedding: Gemma's 1 + w, not w (issue 52).

The scale is read off the model's own forward (its final norm applied to random residuals, divided
by x / rms(x) in numpy), never through eigenhooks; the circuit, the readout and a token's steering
direction are then checked against numpy on W_U diag(s).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as T
from harness import assert_tiny

import eigenhooks as eh

GEMMA = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)
H, G, DH = 4, 2, 8


def _gemma(fresh: bool):
    torch.manual_seed(0)
    model = T.GemmaForCausalLM(T.GemmaConfig(**GEMMA))
    assert_tiny(model)
    if not fresh:  # trained-looking norms: w far from 0
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.double().eval()


def _final_scale(model) -> np.ndarray:
    """s with final_norm(x) = s * x / rms(x), from the model's own norm (numpy divides)."""
    norm = model.model.norm
    x = torch.randn(5, GEMMA["hidden_size"], dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        y = norm(x).numpy()
    xn = x.numpy()
    x_hat = xn / np.sqrt((xn**2).mean(1, keepdims=True) + norm.eps)
    s = y / x_hat
    np.testing.assert_allclose(s, np.broadcast_to(s[0], s.shape), rtol=1e-6)  # one scale (Gemma's norm runs in fp32)
    return s.mean(0)


def _rows_out(model) -> np.ndarray:
    """W_U diag(s) (vocab, d): logits = W_U final_norm(x) = (W_U diag(s)) x / rms(x)."""
    return model.lm_head.weight.detach().numpy() * _final_scale(model)[None, :]


@pytest.mark.parametrize("fresh", [True, False])
def test_gemma_circuit_copying_folds_one_plus_w(fresh):
    model = _gemma(fresh)
    W_E, W_U = model.model.embed_tokens.weight.detach().numpy(), _rows_out(model)
    for s in eh.spectra(model, heads=True, cache=False):
        attn = model.model.layers[s.layer].self_attn
        O, V = attn.o_proj.weight.detach().numpy(), attn.v_proj.weight.detach().numpy()
        for h in s.heads:
            g = h.head // (H // G)
            F_h = O[:, h.head * DH : (h.head + 1) * DH] @ V[g * DH : (g + 1) * DH]
            w = np.linalg.eigvals(W_U @ F_h @ W_E.T)  # (vocab, vocab): logit i from token j
            assert h.circuit_copying != 0.0
            assert abs(h.circuit_copying - w.real.sum() / np.abs(w).sum()) < 1e-6


@pytest.mark.parametrize("fresh", [True, False])
def test_gemma_token_readout_reads_the_rows_the_logits_use(fresh):
    model = _gemma(fresh)
    u = np.random.default_rng(0).standard_normal(GEMMA["hidden_size"])
    r = eh.read_tokens(model, None, torch.from_numpy(u), k=5, null_draws=50)
    W = _rows_out(model)
    cos = (W / np.linalg.norm(W, axis=1, keepdims=True)) @ (u / np.linalg.norm(u))
    hi = np.argsort(-cos)[:5]
    assert [t for t, _ in r.top] == [str(int(i)) for i in hi]
    np.testing.assert_allclose([s for _, s in r.top], cos[hi], atol=1e-6)
    assert r.null_hi > r.null_lo > 0 and r.score > 0


class _Tok:
    """A tokenizer of digits: "5" is token 5 (enough for ``token_id``)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [int(text)]}

    def decode(self, ids):
        return str(ids[0])


@pytest.mark.parametrize("fresh", [True, False])
def test_gemma_token_direction_is_the_logit_row_the_model_uses(fresh):
    model = _gemma(fresh)
    u = eh.direction.token(model, _Tok(), "7", objective="logit").numpy()
    ref = _rows_out(model)[7]
    np.testing.assert_allclose(u, ref / np.linalg.norm(ref), atol=1e-6)  # scaled_unembedding is float32


def test_logit_direction_is_float64_from_the_stored_weights():
    """A float32 model's logit direction is the float64 product of its stored row and scale, not a float32 one."""
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(
        T.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4)
    ).eval()
    with torch.no_grad():
        model.model.norm.weight.normal_(1.0, 0.3)
    u = eh.direction.token(model, _Tok(), "11", objective="logit").numpy()
    ref = model.lm_head.weight[11].detach().double().numpy() * model.model.norm.weight.detach().double().numpy()
    np.testing.assert_allclose(u, ref / np.linalg.norm(ref), rtol=0, atol=1e-15)
