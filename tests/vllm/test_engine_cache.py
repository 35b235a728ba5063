"""Each (request, position) counts once: a prefix served from vLLM's prefix cache is not computed and not
counted (said per request), and a preempted request's recomputed tokens are not counted twice.

Prompts are longer than one KV block (128 tokens on the CPU backend).
"""

from __future__ import annotations

import torch
from parity import compare, hf_table, processed_tokens
from test_engine_monitor import OPT_IN, OPTS, greedy, shut
from tier import save_tiny_llama, start_engine

import eigenhooks as eh

BLOCK = 128


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(1, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_cached_prefix_is_not_counted_and_said(tiny_llama):
    from vllm.inputs import TokensPrompt

    prefix = _ids(140, 1)
    a, b = prefix + _ids(6, 2), prefix + _ids(9, 3)
    llm = start_engine(tiny_llama, enforce_eager=True, additional_config=OPT_IN)
    try:
        with eh.monitor(llm, **OPTS) as mon:
            first = llm.generate([TokensPrompt(prompt_token_ids=a)], greedy(4))
            second = llm.generate([TokensPrompt(prompt_token_ids=b)], greedy(4))  # its first block is cached
    finally:
        shut(llm)
    req = mon.requests()
    row = req[(req.layer == 0) & (req.target == "ov/modulus")].set_index("request_id")
    ra, rb = first[0].request_id, second[0].request_id
    assert row.loc[ra, "cached_prefix"] == 0 and row.loc[rb, "cached_prefix"] == BLOCK
    assert row.loc[rb, "n_tokens"] == len(b) + 3 - BLOCK and row.loc[ra, "n_tokens"] == len(a) + 3
    # the table is the HF monitor's over the tokens the forwards computed: b without its cached block
    # (its positions start at 128: the null subsample indexes them so)
    seqs = processed_tokens(first + second)
    assert int(mon.summary()["n_tokens"].iloc[0]) == len(seqs[0].token_ids) + len(seqs[1].token_ids) - BLOCK


def test_a_preempted_request_counts_each_position_once(tmp_path):
    from vllm.inputs import TokensPrompt

    folder = save_tiny_llama(tmp_path, max_position_embeddings=4 * BLOCK)  # the tiny Llama, longer sequences

    ps = [TokensPrompt(prompt_token_ids=_ids(140, 10 + i)) for i in range(2)]
    # 5 KV blocks of 128 tokens, one of them vLLM's null block: each prompt takes 2, so both run (4 blocks);
    # past 256 tokens each needs a third and none is free: the scheduler preempts one, which later computes
    # its tokens again
    llm = start_engine(folder, enforce_eager=True, additional_config=OPT_IN, num_gpu_blocks_override=5,
                       enable_prefix_caching=False, max_model_len=4 * BLOCK)  # fmt: skip
    try:
        with eh.monitor(llm, **OPTS) as mon:
            outs = llm.generate(ps, greedy(130))
    finally:
        shut(llm)
    req = mon.requests()
    assert req["recomputed"].sum() > 0, "no request was preempted: the test would not see double counting"
    seqs = processed_tokens(outs)
    compare(mon.summary(), hf_table(folder, seqs, **OPTS))
    row = req[(req.layer == 0) & (req.target == "ov/modulus")].set_index("request_id")
    for s in seqs:
        assert row.loc[s.request_id, "n_tokens"] == len(s.token_ids)
