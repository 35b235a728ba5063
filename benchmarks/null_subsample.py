"""Does measuring the nulls on a token subsample change them? SmolLM2, 4 x 128 real tokens.

    python benchmarks/null_subsample.py [--null-stride 5]

For every layer, the Haar null band (2.5%, mean, 97.5%) with the nulls on every token and
on the default subsample (every 5th token), against the Monte-Carlo standard error of those quantiles
(bootstrap over the K draws): the subsample is acceptable when the differences sit within
that error. Then calibration both ways: 100 Haar-random custom targets, the share of
(target, layer, null seed) triples with p_null < 0.05. With K = 99 draws an exact test
rejects at p <= 0.05 with probability 4/100 (p takes the values 2r/100). Needs `eigenhooks fetch smollm2-135m`.
"""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd
import torch

import eigenhooks as eh
from eigenhooks.monitor import measures
from eigenhooks.run.texts import make_batches, sample_text


def null_draws(mon, layer: int) -> np.ndarray:
    mon._acc.flush()
    st = mon._acc.current(layer)
    ns = float(st["tgt"][0][measures.TGT_FIELDS.index("n_sub")])
    return st["null_up"][0].numpy() / ns


def boot_se(x: np.ndarray, q: float, reps: int = 2000) -> float:
    g = np.random.default_rng(0)
    return float(np.std([np.quantile(g.choice(x, x.size), q) for _ in range(reps)]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--null-stride", type=int, default=5)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--targets", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=512, help="band comparison on this many tokens (4 x 128 per forward)")
    ap.add_argument("--null-seed", type=int, default=0, help="seed of the band comparison's draws")
    ap.add_argument("--no-calibration", action="store_true", help="the band comparison only")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model, tok = eh.zoo.load("smollm2-135m")
    batches = make_batches(tok, [sample_text()], max_tokens=args.tokens, seq_len=128, batch_size=4)
    ids = batches[0]
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    mons = {}
    for cap in (1, args.null_stride):
        with (
            eh.monitor(model, targets=[("ov", "modulus")], null_stride=cap, null_seed=args.null_seed) as mon,
            torch.no_grad(),
        ):
            for b in batches:
                model(input_ids=b, attention_mask=torch.ones_like(b))
        mons[cap] = mon
    n = sum(b.numel() for b in batches)
    print(
        f"SmolLM2, {n} tokens in {len(batches)} forwards; Haar null band on every token vs on every {args.null_stride}th token"
    )
    print("layer |  lo(all) lo(sub)  |d|/se |  mean(all) mean(sub) |d|/se |  hi(all) hi(sub)  |d|/se")
    ratios = []
    for i in range(eh.get_adapter(model).n_layers):
        a, s = null_draws(mons[1], i), null_draws(mons[args.null_stride], i)
        cells = []
        for q in (0.025, None, 0.975):
            va, vs = (a.mean(), s.mean()) if q is None else (np.quantile(a, q), np.quantile(s, q))
            se = (a.std(ddof=1) / np.sqrt(a.size)) if q is None else boot_se(a, q)
            r = abs(va - vs) / se if se > 0 else float("nan")
            ratios.append(r)
            cells.append(f"{va:7.3f} {vs:7.3f} {r:6.2f}")
        print(f"{i:5d} | " + " | ".join(cells))
    ratios = np.array(ratios)
    print(
        f"|difference| / Monte-Carlo SE: median {np.median(ratios):.2f}, 90% {np.quantile(ratios, 0.9):.2f}, max {ratios.max():.2f}"
    )
    if args.no_calibration:
        return
    g = torch.Generator().manual_seed(7)
    targets = []
    for j in range(args.targets):
        u = torch.randn(eh.get_adapter(model).d_model, generator=g, dtype=torch.float64)
        targets.append((f"rand{j}", u / u.norm()))
    for cap in (1, args.null_stride):
        dfs = []
        for seed in range(args.seeds):
            with (
                eh.monitor(
                    model, targets=targets, null_draws=99, fnull_draws=0, eig_top=0, null_stride=cap, null_seed=seed
                ) as mon,
                torch.no_grad(),
            ):
                model(**batch)
            dfs.append(mon.summary().assign(seed=seed))
        df = pd.concat(dfs)
        hit = df["p_null"] < 0.05
        # one target's rho is correlated across layers and seeds: cluster the share by target
        per = hit.groupby(df["target"]).mean()
        se = per.std(ddof=1) / np.sqrt(len(per))
        print(
            f"calibration, nulls on {'every token' if cap == 1 else f'every {cap}th token'}: {len(df)} pairs "
            f"({args.seeds} null seeds), p_null < 0.05 in {hit.mean():.3f} ± {2 * se:.3f} (2 SE, clustered by "
            f"target); p_binom < 0.05 in {(df['p_binom'] < 0.05).mean():.3f}"
        )


if __name__ == "__main__":
    main()
