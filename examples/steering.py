"""Steer the last layer of the zoo GPT-2 toward a token's direction with a rank-1 change.

The change O' = O + alpha u w^T makes u the principal eigenvector of the layer's F with the
requested gap ratio. The weights are restored bit-exactly when the block ends.
"""

import torch

import eigenhooks as eh

model, tok = eh.zoo.load("gpt2-tiny")
u = eh.direction.token(model, tok, " return")
target = tok(" return", add_special_tokens=False)["input_ids"][0]
batch = tok(["def f(x):\n    y = x + 1\n   "], return_tensors="pt")

with eh.steer(model, u, gap_ratio=0.1) as s, torch.no_grad():
    model(**batch)
    rep = s.report(target_token=target)

print(
    f"layer {rep.layer}: alpha {rep.alpha:.2f}, lambda_1 {rep.lambda_1_before:.3f} -> {rep.lambda_1:.3f}, "
    f"gap ratio {rep.gap_ratio_before:.3f} -> {rep.gap_ratio:.3f}, cos(v1', u) {rep.cos_v1_u:.4f}"
)
print(f"final residuals' mean |cos| with u: {rep.alignment_before:.3f} -> {rep.alignment_after:.3f}")
print(f"p(' return'): {rep.prob_before:.2e} -> {rep.prob_after:.2e}")
print("The construction is symmetric in u -> -u: it makes the span of u principal, and a token is")
print("pushed toward +u or -u by the sign of w . (V x). Here the push lowers p(' return').")
