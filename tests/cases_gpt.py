"""GPT-lineage cases (eigenhooks/models/gpt.py)."""

import transformers as T
from harness import Case, seeded, sum_mid, token_inputs

TOK = token_inputs()


def _h(m):
    return m.base_model.h


CASES = {
    "gpt2": Case(
        seeded(lambda: T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=64, n_positions=32))),
        "gpt2",
        sum_mid(_h, lambda b: b.attn),
        TOK,
        generate=True,
    ),
    "gpt_neo": Case(
        seeded(
            lambda: T.GPTNeoForCausalLM(
                T.GPTNeoConfig(
                    num_layers=2,
                    num_heads=2,
                    hidden_size=16,
                    vocab_size=64,
                    max_position_embeddings=32,
                    attention_types=[[["global", "local"], 1]],
                    window_size=4,
                )
            )
        ),
        "gpt_neo",
        sum_mid(_h, lambda b: b.attn),
        TOK,
        generate=True,
    ),
    "gpt_neox (parallel)": Case(
        seeded(
            lambda: T.GPTNeoXForCausalLM(
                T.GPTNeoXConfig(
                    num_hidden_layers=2, num_attention_heads=2, hidden_size=16, intermediate_size=32, vocab_size=64
                )
            )
        ),
        "gpt_neox",
        None,
        TOK,
        generate=True,
    ),
    "gpt_neox (sequential)": Case(
        seeded(
            lambda: T.GPTNeoXForCausalLM(
                T.GPTNeoXConfig(
                    num_hidden_layers=2,
                    num_attention_heads=2,
                    hidden_size=16,
                    intermediate_size=32,
                    vocab_size=64,
                    use_parallel_residual=False,
                )
            )
        ),
        "gpt_neox",
        sum_mid(lambda m: m.base_model.layers, lambda b: b.attention),
        TOK,
        generate=True,
    ),
    "gptj": Case(
        seeded(
            lambda: T.GPTJForCausalLM(
                T.GPTJConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=64, rotary_dim=4, n_positions=32)
            )
        ),
        "gptj",
        None,
        TOK,
        generate=True,
    ),
    "opt": Case(
        seeded(
            lambda: T.OPTForCausalLM(
                T.OPTConfig(
                    num_hidden_layers=2,
                    num_attention_heads=2,
                    hidden_size=16,
                    ffn_dim=32,
                    vocab_size=64,
                    word_embed_proj_dim=16,
                    max_position_embeddings=32,
                )
            )
        ),
        "opt",
        sum_mid(lambda m: m.base_model.decoder.layers, lambda b: b.self_attn),
        TOK,
        generate=True,
    ),
    "opt (post-norm)": Case(
        seeded(
            lambda: T.OPTForCausalLM(
                T.OPTConfig(
                    num_hidden_layers=2,
                    num_attention_heads=2,
                    hidden_size=16,
                    ffn_dim=32,
                    vocab_size=64,
                    word_embed_proj_dim=16,
                    max_position_embeddings=32,
                    do_layer_norm_before=False,
                )
            )
        ),
        "opt",
        sum_mid(
            lambda m: m.base_model.decoder.layers, lambda b: b.self_attn, then=lambda b, x: b.self_attn_layer_norm(x)
        ),
        TOK,
        generate=True,
    ),
}
