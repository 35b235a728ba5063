"""Rank-1 steering vs activation addition at matched alignment: which is gentler?

On the zoo GPT-2, toward a token's direction u at the last layer:
  - rank-1 steering (eh.steer) at a given gap ratio gives some mean |cos| of the final
    residuals with u on the steering prompts;
  - activation addition adds c*u to the same layer's output, with c solved by bisection
    so that the mean |cos| matches;
then both are compared by the KL divergence KL(plain || steered) of the next-token
distribution on unrelated prompts (and on the steering prompts).

Usage: python benchmarks/steer_vs_actadd.py [--token " return"] [--gap-ratio 0.1]
"""

from __future__ import annotations

import argparse

import torch

import eigenhooks as eh
from eigenhooks.steering import mean_abs_cos

STEER_PROMPTS = ["def f(x):\n    y = x + 1\n   ", "class Stack:\n    def pop(self):\n       "]
UNRELATED = [
    "The for statement is used to iterate over the elements of a sequence",
    "An assignment statement evaluates the expression list",
    "Exceptions are a means of breaking out of the normal flow of control",
    "A lambda expression yields an anonymous function object",
]


@torch.no_grad()
def run(model, tok, prompts, block, add=None):
    """Next-token log-probs at the last position, and the final block's outputs."""
    outs, finals = [], []
    for p in prompts:
        got = {}

        def hook(m, a, o):
            x = o[0] if isinstance(o, tuple) else o
            if add is not None:
                x = x + add.to(x.dtype)
            got["x"] = x
            return (x, *o[1:]) if isinstance(o, tuple) else x

        h = block.register_forward_hook(hook)
        try:
            logits = model(**tok(p, return_tensors="pt")).logits
        finally:
            h.remove()
        outs.append(torch.log_softmax(logits[0, -1].double(), -1))
        finals.append(got["x"][0])
    return torch.stack(outs), torch.cat(finals)


def kl(p_log, q_log):
    return float((p_log.exp() * (p_log - q_log)).sum(-1).mean())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--token", default=" return")
    ap.add_argument("--gap-ratio", type=float, default=0.1)
    a = ap.parse_args()
    model, tok = eh.zoo.load("gpt2-tiny")
    block = model.transformer.h[-1]
    u = eh.direction.token(model, tok, a.token)
    plain_s, fin_plain = run(model, tok, STEER_PROMPTS, block)
    plain_u, _ = run(model, tok, UNRELATED, block)
    with eh.steer(model, u, gap_ratio=a.gap_ratio, mode="hook") as s:
        r1_s, fin_r1 = run(model, tok, STEER_PROMPTS, block)
        r1_u, _ = run(model, tok, UNRELATED, block)
    target = mean_abs_cos(fin_r1, u)
    lo, hi = 0.0, 1.0
    while mean_abs_cos(run(model, tok, STEER_PROMPTS, block, add=hi * u.float())[1], u) < target:
        hi *= 2
    for _ in range(40):
        mid = (lo + hi) / 2
        if mean_abs_cos(run(model, tok, STEER_PROMPTS, block, add=mid * u.float())[1], u) < target:
            lo = mid
        else:
            hi = mid
    add = hi * u.float()
    aa_s, fin_aa = run(model, tok, STEER_PROMPTS, block, add=add)
    aa_u, _ = run(model, tok, UNRELATED, block, add=add)
    print(f"direction: token {a.token!r}; rank-1 steering at gap ratio {a.gap_ratio} (alpha {s.alpha:.2f})")
    print(
        f"mean |cos| of final residuals with u on steering prompts: plain {mean_abs_cos(fin_plain, u):.3f}, "
        f"rank-1 {target:.3f}, activation addition (c = {hi:.2f}) {mean_abs_cos(fin_aa, u):.3f}  (matched)"
    )
    print(
        f"KL(plain || steered), next token, unrelated prompts: rank-1 {kl(plain_u, r1_u):.4f}, "
        f"activation addition {kl(plain_u, aa_u):.4f}"
    )
    print(
        f"KL(plain || steered), next token, steering prompts:  rank-1 {kl(plain_s, r1_s):.4f}, "
        f"activation addition {kl(plain_s, aa_s):.4f}"
    )
    t = tok(a.token, add_special_tokens=False)["input_ids"][0]
    print(
        f"p({a.token!r}) on steering prompts: plain {plain_s[:, t].exp().mean():.2e}, "
        f"rank-1 {r1_s[:, t].exp().mean():.2e}, activation addition {aa_s[:, t].exp().mean():.2e}"
    )


if __name__ == "__main__":
    main()
