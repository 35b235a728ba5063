"""A contest on SmolLM2-135M: rank-1 paper, rank-1 exact+signed, and activation addition.

All three write into the same place, the output of the last layer's attention (its output
projection), toward the same unit direction u (``eh.direction.token``, default " Paris"):
  - paper:       O' = O + alpha u wᵀ, w = V u / ||V u||      (eh.steer(method="paper"))
  - exact+signed: O' = O + (lambda u - F u) bᵀ, bᵀ V u = 1, b signed from data
                 (eh.steer(method="exact"), the default), lambda = uᵀFu + alpha ||V u||
  - actadd:      o' = o + c u at every token (a forward hook on the output projection).
For each strength it measures the target token's next-token probability at the last
position of 10 varied prompts (mean, and on how many it rose) and the KL divergence
KL(plain || steered) of the next-token distribution over every position of 8 unrelated
prompts. The common strength axis is what each method writes: the mean norm of the change
of the attention output over the unrelated prompts' tokens. Methods are compared at
matched KL: the best target probability each reaches within a KL budget.

Writes docs/steering_contest.png and docs/steering_contest.md (other tokens: _<token> suffix). A few minutes on 2 cores.

Usage: python benchmarks/steer_vs_actadd.py [--token " Paris"] [--points 12] [--out docs]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

import eigenhooks as eh

STEER_PROMPTS = [
    "The capital of France is",
    "I flew from New York to",
    "My favourite city in Europe is",
    "The weather today is",
    "She opened the door and saw",
    "The Eiffel Tower is located in",
    "def add(a, b):\n    return",
    "The best way to learn music is",
    "He bought a ticket to",
    "Once upon a time, there was a",
]
UNRELATED = [
    "The mitochondria is the powerhouse of the cell, producing energy through respiration.",
    "To make a simple tomato sauce, heat olive oil and add chopped garlic.",
    "for i in range(10):\n    print(i * i)",
    "The derivative of x squared is two times x, by the power rule.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Please remember to water the plants while I am away this weekend.",
    "A binary search tree keeps its keys in sorted order for fast lookup.",
    "The orchestra tuned their instruments before the concert began.",
]
BUDGETS = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
METHODS = ("paper", "exact+signed", "actadd")


class Meter:
    """Forward passes with the attention-output change measured at the steered projection."""

    def __init__(self, model, tok, o_proj):
        self.model, self.tok, self.o_proj = model, tok, o_proj
        self.enc_s = [tok(p, return_tensors="pt") for p in STEER_PROMPTS]
        self.enc_u = [tok(p, return_tensors="pt") for p in UNRELATED]

    @torch.no_grad()
    def run(self, add=None):
        """(last-position log-probs (10, V), all-position unrelated log-probs (n, V), mean ||Δ o||)."""
        delta = []

        def hook(m, a, o):
            if add is None:
                return o
            d = add(a[0], o)
            delta.append(torch.linalg.vector_norm(d.double(), dim=-1).flatten())
            return o + d

        h = self.o_proj.register_forward_hook(hook)
        try:
            last = torch.stack([torch.log_softmax(self.model(**e).logits[0, -1].double(), -1) for e in self.enc_s])
            delta.clear()  # the strength axis is measured on the unrelated prompts
            unrel = torch.cat([torch.log_softmax(self.model(**e).logits[0].double(), -1) for e in self.enc_u])
        finally:
            h.remove()
        return last, unrel, (float(torch.cat(delta).mean()) if delta else 0.0)


def kl(p_log, q_log) -> float:
    return float((p_log.exp() * (p_log - q_log)).sum(-1).mean())


def rank1_add(s):
    """The change a (bᵀ z) of a Steer's rank-1 edit, as a function of the projection's input z."""
    a, b = s.change.a, s.change.b
    return lambda z, o: ((z.double() @ b)[..., None] * a).to(o.dtype)


def sweep(model, tok, meter, u, t, points):
    plain_s, plain_u, _ = meter.run()
    rows = []
    alphas = np.geomspace(0.3, 300, points)
    cs = np.geomspace(1.0, 3000, points)
    for method in METHODS:
        for x in alphas if method != "actadd" else cs:
            if method == "actadd":
                add = lambda z, o, c=float(x): (c * u).to(o.dtype).expand_as(o)  # noqa: E731
            else:
                kw = {"method": "paper"} if method == "paper" else {}
                s = eh.steer(model, u, alpha=float(x), mode="hook", **kw)
                add = rank1_add(s)
            last, unrel, strength = meter.run(add)
            p0, p1 = plain_s[:, t].exp(), last[:, t].exp()
            rows.append(
                {
                    "method": method,
                    "param": float(x),
                    "strength": strength,
                    "p_target": float(p1.mean()),
                    "raised": int((p1 > p0).sum()),
                    "kl_unrelated": kl(plain_u, unrel),
                }
            )
    return float(plain_s[:, t].exp().mean()), rows


def matched(rows, budget):
    """Per method: the point with the highest target probability whose KL is within budget."""
    out = {}
    for m in METHODS:
        ok = [r for r in rows if r["method"] == m and r["kl_unrelated"] <= budget]
        out[m] = max(ok, key=lambda r: r["p_target"]) if ok else None
    return out


def plot(rows, p_plain, word, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    for m, c in zip(METHODS, ("tab:blue", "tab:red", "tab:green")):
        r = [x for x in rows if x["method"] == m]
        s = [x["strength"] for x in r]
        ax[0].plot(s, [x["p_target"] for x in r], "o-", color=c, label=m)
        ax[1].plot(s, [max(x["kl_unrelated"], 1e-6) for x in r], "o-", color=c, label=m)
        ax[2].plot([max(x["kl_unrelated"], 1e-6) for x in r], [x["p_target"] for x in r], "o-", color=c, label=m)
    for a in ax[:2]:
        a.set_xscale("log")
        a.set_xlabel("strength: mean ||Δ attention output|| per token (unrelated prompts)")
    ax[0].set_ylabel(f"p({word!r}), mean over 10 prompts")
    ax[0].axhline(p_plain, color="gray", ls=":", label="unsteered")
    ax[1].set_yscale("log")
    ax[1].set_ylabel("KL(plain || steered), unrelated prompts [nats]")
    ax[2].set_xscale("log")
    ax[2].set_xlabel("KL on unrelated prompts [nats]")
    ax[2].set_ylabel(f"p({word!r})")
    ax[2].axhline(p_plain, color="gray", ls=":")
    ax[2].set_title("at matched KL: higher is better")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M-Instruct, last layer (29), toward {word!r}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(rows, p_plain, word) -> str:
    lines = [
        f"Target {word!r}; unsteered mean p = {p_plain:.3g}. Best mean p reached within each KL budget "
        "(KL(plain || steered) on unrelated prompts), with the number of the 10 prompts on which p rose "
        "and the method's strength parameter (alpha for rank-1, c for activation addition).",
        "",
        "| KL budget | " + " | ".join(METHODS) + " |",
        "|---|" + "---|" * len(METHODS),
    ]
    for budget in BUDGETS:
        best = matched(rows, budget)
        cells = [
            "—" if r is None else f"{r['p_target']:.3g} ({r['raised']}/10, {r['param']:.3g})"
            for r in (best[m] for m in METHODS)
        ]
        lines.append(f"| {budget:g} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "All points:",
        "",
        "| method | param | strength | mean p | raised | KL unrelated |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['param']:.3g} | {r['strength']:.3g} | {r['p_target']:.3g} | "
            f"{r['raised']}/10 | {r['kl_unrelated']:.3g} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--token", default=" Paris")
    ap.add_argument("--points", type=int, default=12)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs"))
    a = ap.parse_args()
    t0 = time.time()
    torch.manual_seed(0)
    model, tok = eh.zoo.load("smollm2-135m")
    ad = eh.get_adapter(model)
    u = eh.direction.token(model, tok, a.token)
    t = eh.direction.token_id(tok, a.token)
    meter = Meter(model, tok, ad.layers[-1].o_proj)
    p_plain, rows = sweep(model, tok, meter, u, t, a.points)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "steering_contest" + ("" if a.token == " Paris" else "_" + a.token.strip().lower())
    plot(rows, p_plain, a.token, out / f"{stem}.png")
    md = table(rows, p_plain, a.token)
    head = (
        f"# Steering contest on SmolLM2-135M-Instruct: toward {a.token!r}\n\n"
        "Generated by `python benchmarks/steer_vs_actadd.py"
        + ("" if a.token == " Paris" else f" --token {a.token!r}")
        + f"` in {time.time() - t0:.0f} s on the CPU (the setup is in that file's docstring; the reading "
        f"is in [steering.md](steering.md)).\n\n![contest]({stem}.png)\n\n"
    )
    (out / f"{stem}.md").write_text(head + md + "\n")
    print(md)
    print(f"\nwrote {out / (stem + '.png')} and {out / (stem + '.md')} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
