"""The acid test of the monitor's verdict, per layer, on its own kept tokens (issue 56).

    python benchmarks/verdict_calibration.py [--model smollm2-135m] [--texts 12] [--docs 64] [--tokens 128]
        [--targets 240] [--draws 4999]

benchmarks/verdict_null.py checked the null's design on every token of 600 documents. This checks the test the
monitor runs: its own kept tokens (``verdict_tokens`` a layer, chosen in the forward), its own split of them into
an estimation and a scoring half, its own draws (``verdict.covariance``) at its own K, its own ranks.

The standard library's docstrings (``eigenhooks.run.corpus``) are cut into ``--texts`` disjoint texts of ``--docs``
documents (each its first ``--tokens`` tokens); the monitor runs on each. For every layer, every k in (1, 2) and
every ordered pair of texts (A, C), A != C: ``--targets`` subspaces are drawn by the null's own rule from C's
estimation half (C is text the test never sees), and each is ranked among ``--draws`` draws from A's estimation
half, scored on A's scoring half, as ``verdict.layer_columns`` ranks v_1. Under the null a target so drawn is
exchangeable with the draws, and the share with p < 0.05 (0.01) should be 5% (1%). Printed per layer and k: each
question's shares and their one-sided 95% Clopper-Pearson upper bounds; the bar: at most 6% (1.5%) on every layer.

Pooling over many pairs matters: one pair's rate carries that pair's texts (how far C's covariance is from A's),
which no number of targets from one C averages out.
"""

from __future__ import annotations

import argparse
import time

import torch
from verdict_null import upper95  # the design study's bound, one definition (benchmarks/ is the script's path)

import eigenhooks as eh
from eigenhooks.monitor.verdict import covariance, per_sequence, rank_p, split
from eigenhooks.run.corpus import describe, stdlib_docstrings
from eigenhooks.run.corpus import split as split_docs


def kept(model, tok, docs, tokens: int) -> dict[int, dict]:
    """The monitor's kept tokens of each layer after one run over ``docs`` (8 documents a batch)."""
    enc = tok([d.text for d in docs], return_tensors="pt", padding=True, truncation=True, max_length=tokens)
    with eh.monitor(model) as mon, torch.no_grad():
        for s in range(0, len(docs), 8):
            model(input_ids=enc["input_ids"][s : s + 8], attention_mask=enc["attention_mask"][s : s + 8])
        sample, layers, seed = mon._acc.sample, sorted(mon._plan.layers), mon.config.sample_seed
        return {i: split(sample.host(i), seed) for i in layers}


def scored(frames: torch.Tensor, part) -> tuple[torch.Tensor, torch.Tensor]:
    """The tilt and the static alignment of each frame on a text's scoring half, as the verdict scores them."""
    _, _, Xb_S, Xm_S, seq_S, _, n_S = part
    sp, sm = per_sequence(frames, Xb_S, Xm_S, seq_S, n_S)
    n = float(len(seq_S))
    return (sm - sp).sum(1) / n, sp.sum(1) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--texts", type=int, default=12)
    ap.add_argument("--docs", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--targets", type=int, default=240, help="a pair's targets (a layer has texts x (texts-1) pairs)")
    ap.add_argument("--draws", type=int, default=4999)
    args = ap.parse_args()
    model, tok = eh.load_model(args.model, dtype=torch.float32)
    tok.padding_side = "right"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    docs = stdlib_docstrings()
    texts = [t[: args.docs] for t in split_docs(docs, seed=11, parts=args.texts)]
    assert all(len(t) == args.docs for t in texts), "too few documents for --texts x --docs"
    print(f"{args.model}: {describe(docs)}; {args.texts} texts of {args.docs} documents, ≤ {args.tokens} tokens each")
    t0 = time.perf_counter()
    parts = [kept(model, tok, t, args.tokens) for t in texts]
    layers = sorted(parts[0])
    p0 = parts[0][layers[0]]
    print(f"monitor runs: {time.perf_counter() - t0:.0f} s; a text's halves: {p0[5]} and {p0[6]} sequences, "
          f"{len(p0[1])} and {len(p0[4])} tokens (layer {layers[0]})")  # fmt: skip
    n_pairs = args.texts * (args.texts - 1)
    print(f"{n_pairs * args.targets} targets a layer and k, each ranked among {args.draws} draws")
    print("layer | k | tilt p<.05 (ub) | tilt p<.01 (ub) | static p<.05 (ub) | static p<.01 (ub)")
    bounds = []  # (question, alpha, layer, k, upper bound)
    for layer in layers:
        for k in (1, 2):
            x = {(q, a): 0 for q in ("tilt", "static") for a in (0.05, 0.01)}
            fits = [covariance.fit(p[layer][0], p[layer][1], p[layer][5]) for p in parts]
            for i, A in enumerate(parts):
                gen = torch.Generator().manual_seed(1_000 * layer + 10 * k + i)
                u = float(torch.rand(1, generator=gen))
                pool = scored(covariance.draws(fits[i], args.draws, k, gen), A[layer])
                for j in range(len(parts)):
                    if j == i:
                        continue
                    targ = scored(covariance.draws(fits[j], args.targets, k, gen), A[layer])
                    for q, t, null in (("tilt", targ[0], pool[0]), ("static", targ[1], pool[1])):
                        p = rank_p(t, null, u)
                        for a in (0.05, 0.01):
                            x[(q, a)] += int((p < a).sum())
            n = n_pairs * args.targets
            for (q, a), c in x.items():
                bounds.append((q, a, layer, k, upper95(c, n)))
            print(
                f"{layer:2d} | {k} | " + " | ".join(f"{c / n:.2%} ({upper95(c, n):.2%})" for c in x.values()),
                flush=True,
            )
    for q, a in x:
        bar = 0.06 if a == 0.05 else 0.015
        mine = [b for b in bounds if b[:2] == (q, a)]
        top = max(mine, key=lambda b: b[4])
        over = [(b[2], b[3]) for b in mine if b[4] > bar]
        print(f"{q} p<{a}: largest upper bound {top[4]:.2%} (layer {top[2]}, k {top[3]}); over the bar {bar:.1%}: "
              f"{len(over)} of {len(mine)} {over}")  # fmt: skip
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
