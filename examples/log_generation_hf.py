"""Wrap an HF model and log alignment during generation (offline, on the zoo GPT-2).

Nothing in the generation code changes: the `with` block adds hooks and removes them.
"""

import torch

import eigenhooks as eh

model, tok = eh.zoo.load("gpt2-tiny")
prompts = ["def read_file(path):", "The for statement is used to"]
tok.padding_side = "left"  # decoder-only models generate from left-padded batches
batch = tok(prompts, return_tensors="pt", padding=True)

with eh.monitor(model, sink="generation_stats.jsonl") as mon, torch.no_grad():
    out = model.generate(**batch, max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)

for text in tok.batch_decode(out, skip_special_tokens=True):
    print(repr(text))
cols = ["layer", "target", "n_tokens", "gamma_pre", "gamma_mid", "rho", "null_rho_lo", "null_rho_hi", "p_null", "verdict"]
print(mon.summary()[cols].to_string(index=False))
