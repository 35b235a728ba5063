"""Power of the verdict under its own null: plants of known size and sign on SmolLM2 (issue 56).

    python benchmarks/verdict_power.py [--layer 9] [--seeds 0 1 2] [--sizes -0.5 0.5 1 2 4] [--docs 40]
        [--plant rank1|direct]

A pass is one monitored run of ``--docs`` standard-library docstrings (64 tokens each; a window per seed, none of
them the documents benchmarks/verdict_null.py studied) with the paper's rank-1 plant at one layer L:
O_L' = O_L + alpha u wᵀ (``eh.steer(method="paper")``), u the layer's unedited v_1, strength s = alpha ||V u|| /
lambda_1 (lambda_1' = (1 + s) lambda_1). The target is u itself (a custom target: it stays put whatever the plant
does to the ranking). Its true effect is measured on every token of the pass: the change of Δγ = γ_mid − γ_pre
(all tokens) against the unedited model on the same documents, and the planted tilt's lift over the null's
median (the true lift: Δγ on every token less the null's median). Each pass prints the verdict at L, its q, the tilt
with its interval, and ``detectable_tilt``.

The rank-1 plant grows lambda_1, which need not raise Δγ (it lowered it at layer 9). ``--plant direct`` plants a tilt
of known sign on every token instead: a forward hook on layer L's attention adds c (uᵀx) u to its output, x the
layer's input (the residual stream at ``pre``): each token's ``mid`` moves along u by c times its own ``pre``
component, the way it already points for c > 0 (|cos(mid, u)| rises wherever attention did not flip that sign) and
back for c < 0. Not a weight edit (the added path skips attention's mixing), a plant whose sign is known, and its true
size measured on every token; ``--sizes`` are then c. Plant it where v_1's own lift is about 0 (layer 15 on SmolLM2),
so that the planted change is the lift the verdict tests.
"""

from __future__ import annotations

import argparse

import torch

import eigenhooks as eh
from eigenhooks.models import get_adapter
from eigenhooks.run.corpus import split, stdlib_docstrings
from eigenhooks.steer.rank1 import value_stack


class Direct:
    """The direct plant: layer ``layer``'s attention output gains c (uᵀx) u, x the layer's input (a context)."""

    def __init__(self, model, layer: int, u: torch.Tensor, c: float):
        self.block, self.u, self.c, self.x = model.model.layers[layer], u.float(), c, None

    def __enter__(self):
        def keep(module, args, kwargs):
            self.x = kwargs.get("hidden_states", args[0] if args else None)

        def add(module, args, output):
            return (output[0] + self.c * (self.x @ self.u)[..., None] * self.u, *output[1:])

        self.handles = [
            self.block.register_forward_pre_hook(keep, with_kwargs=True),
            self.block.self_attn.register_forward_hook(add),
        ]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def run_pass(model, tok, docs, layer: int, u: torch.Tensor, seed: int, alpha: float | None, plant: str = "rank1"):
    """The summary row of target u at ``layer`` (planted with ``alpha``, or none)."""
    edit = None
    if alpha is not None:
        if plant == "direct":
            edit = Direct(model, layer, u, alpha)
        else:
            edit = eh.steer(model, u.float(), layer=layer, alpha=alpha, method="paper", mode="edit")
        edit.__enter__()
    try:
        enc = tok([d.text for d in docs], return_tensors="pt", padding=True, truncation=True, max_length=64)
        with eh.monitor(model, targets=[("ov", "modulus"), ("u", {layer: u.float()})], null_seed=seed) as mon:
            with torch.no_grad():
                for s in range(0, len(docs), 8):
                    model(input_ids=enc["input_ids"][s : s + 8], attention_mask=enc["attention_mask"][s : s + 8])
        df = mon.summary()
    finally:
        if edit is not None:
            edit.__exit__(None, None, None)
    return df[(df["layer"] == layer) & (df["target"] == "u")].iloc[0].to_dict()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--layer", type=int, default=9)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--sizes", type=float, nargs="+", default=[-0.5, 0.5, 1.0, 2.0, 4.0])
    ap.add_argument("--docs", type=int, default=40)
    ap.add_argument("--plant", choices=["rank1", "direct"], default="rank1")
    args = ap.parse_args()
    model, tok = eh.load_model(args.model, dtype=torch.float32)
    tok.padding_side = "right"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    spec = eh.spectra(model, rank="modulus")[args.layer]
    u = spec.basis[:, 0].double()
    lam = float(spec.lambda_1.real)
    vu = float((value_stack(get_adapter(model).factors(args.layer)) @ u).norm())
    pool = split(stdlib_docstrings(), seed=7, parts=4)[3]  # not the documents verdict_null.py studied
    print(f"{args.model} layer {args.layer}: lambda_1 {lam:.3f}, {args.docs} documents a pass, plant {args.plant}")
    print("seed | s | true ΔΔγ (all tokens) | true lift (all tokens) | tilt [95% CI] | null median | lift | detectable "
          "| q | verdict")  # fmt: skip
    for seed in args.seeds:
        docs = pool[seed * args.docs : (seed + 1) * args.docs]
        base = run_pass(model, tok, docs, args.layer, u, seed, None)
        dg0 = base["gamma_mid"] - base["gamma_pre"]
        scale = 1.0 if args.plant == "direct" else lam / vu  # direct: the size is c itself
        rows = [(0.0, base)] + [
            (s, run_pass(model, tok, docs, args.layer, u, seed, s * scale, args.plant)) for s in args.sizes
        ]
        for s, r in rows:
            true = r["gamma_mid"] - r["gamma_pre"] - dg0
            lift = r["gamma_mid"] - r["gamma_pre"] - r["tilt_null_median"]  # what the verdict tests, on every token
            print(
                f"{seed} | {s:+.2f} | {true:+.4f} | {lift:+.4f} | {r['tilt']:+.4f} [{r['tilt_ci_lo']:+.4f}, {r['tilt_ci_hi']:+.4f}] | "
                f"{r['tilt_null_median']:+.4f} | {r['tilt_lift']:+.4f} | {r['detectable_tilt']:.4f} | {r['q_tilt']:.2g} | "
                f"{r['verdict']}",
                flush=True,
            )


if __name__ == "__main__":
    main()
