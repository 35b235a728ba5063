"""A tiny Llama written as a GGUF file with the ``gguf`` package's writer, for loading tests.

``write_tiny_gguf(path)`` builds a seeded ``LlamaForCausalLM`` from a config (2 layers, d = 32,
grouped-query attention), writes its weights and a byte-level BPE tokenizer under llama.cpp's
names (``token_embd``, ``blk.N.attn_q`` ...; q and k permuted the way llama.cpp's converter
does, which transformers undoes on load) and returns the model, so that what transformers reads
back can be compared with what was written.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers as T
from harness import assert_tiny

CONFIG = dict(
    vocab_size=259,  # 256 byte tokens, 2 merges, <|endoftext|>
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=False,
    bos_token_id=258,
    eos_token_id=258,
)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (rotary halves interleaved); transformers reverses it on load."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokens() -> tuple[list[str], list[str]]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte = bytes_to_unicode()
    tokens = [byte[b] for b in range(256)]
    merges = [f"{byte[ord('t')]} {byte[ord('h')]}", f"{byte[ord(' ')]} {byte[ord('t')]}"]
    tokens += ["th", byte[ord(" ")] + "t", "<|endoftext|>"]
    return tokens, merges


def build_model(seed: int = 0, std: float = 0.3) -> T.LlamaForCausalLM:
    torch.manual_seed(seed)
    model = T.LlamaForCausalLM(T.LlamaConfig(**CONFIG))
    assert_tiny(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model.eval()


def write_tiny_gguf(
    path, seed: int = 0, name: str = "tiny-llama", pad_token_id: int | None = None, add_bos: bool | None = None
) -> T.LlamaForCausalLM:
    """Write a seeded tiny Llama to ``path`` (float32 tensors) and return the model written; with
    ``pad_token_id`` and ``add_bos`` the file also records its padding token and its BOS rule."""
    import gguf

    model = build_model(seed)
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(CONFIG["rope_parameters"]["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    tokens, merges = _tokens()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 1) + [3])  # the last one is a control token
    w.add_token_merges(merges)
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    if pad_token_id is not None:
        w.add_pad_token_id(pad_token_id)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert Path(path).stat().st_size > 0
    return model
