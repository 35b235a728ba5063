"""TransformerLens: eigenhooks' hooks next to your own ablation in one run_with_hooks call.

Zeroing layer 2's attention output makes its 'mid' equal its 'pre', so the attention
step can no longer tilt tokens: rho of layer 2 falls to 0.
"""

import torch
from transformer_lens import TransformerBridge

import eigenhooks as eh

hf_model, tok = eh.zoo.load("gpt2-tiny")
bridge = TransformerBridge.boot_transformers("gpt2", hf_model=hf_model, tokenizer=tok, dtype=torch.float32)
ids = tok(
    ["The while statement is used for repeated execution as long as an expression is true."], return_tensors="pt"
)["input_ids"]

plain = eh.monitor(bridge, attach=False)
bridge.run_with_hooks(ids, fwd_hooks=plain.fwd_hooks())

ablated = eh.monitor(bridge, attach=False)
zero_attn = ("blocks.2.hook_attn_out", lambda act, hook: torch.zeros_like(act))
bridge.run_with_hooks(ids, fwd_hooks=[zero_attn, *ablated.fwd_hooks()])

for name, mon in (("plain", plain), ("layer-2 attention ablated", ablated)):
    df = mon.summary()
    row = df[(df.layer == 2) & (df["target"] == "ov/modulus")].iloc[0]
    print(f"{name:>26}: layer 2 gamma_pre {row.gamma_pre:.4f} gamma_mid {row.gamma_mid:.4f} rho {row.rho:.3f}")
