"""Steer the last layer of the zoo GPT-2 toward a token with an exact, signed rank-1 change.

The change O' = O + (lambda u - F u) b^T (b^T V u = 1) makes u an exact eigenvector of the
layer's F, principal with the requested gap ratio; b is read from calibration tokens so the
typical token is pushed toward +u (docs/steering.md). Weights are restored bit-exactly on exit.
"""

import torch

import eigenhooks as eh

model, tok = eh.zoo.load("gpt2-tiny")
u = eh.direction.token(model, tok, " return")  # the direction that makes ' return' most probable
target = eh.direction.token_id(tok, " return")
batch = tok(["def f(x):\n    y = x + 1\n   "], return_tensors="pt")

for method in ("exact", "paper"):
    with eh.steer(model, u, gap_ratio=0.1, method=method) as s, torch.no_grad():
        model(**batch)
        rep = s.summary(target_token=target)
    print(
        f"{method:5s}: alpha {rep.alpha:.2f}, lambda_1 {rep.lambda_1_before:.3f} -> {rep.lambda_1:.3f}, "
        f"gap ratio {rep.gap_ratio_before:.3f} -> {rep.gap_ratio:.3f}, cos(v1', u) {rep.cos_v1_u:.6f}, "
        f"p(' return') {rep.prob_before:.2e} -> {rep.prob_after:.2e}"
    )
