"""Monitored vs plain forward on SmolLM2 (4 x 128, 2 threads), interleaved, with and without the nulls.

    python benchmarks/bench_monitor_real.py [--reps 7]

Prints min-of-reps times and their ratios, measured side by side in one run. Needs
`eigenhooks fetch smollm2-135m`. Not a timed test: read the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import time

import torch

import eigenhooks as eh

CONFIGS = {
    "default (K=128 Haar, 64 power-step, 16 eig)": {},
    "no nulls (K=1, 0, 0)": {"null_draws": 1, "fnull_draws": 0, "eig_top": 0},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(2)
    model, _ = eh.zoo.load("smollm2-135m")
    ids = torch.randint(100, 20000, (4, 128), generator=torch.Generator().manual_seed(0))

    def fwd():
        with torch.no_grad():
            model(input_ids=ids)

    mons = {name: eh.monitor(model, **kw) for name, kw in CONFIGS.items()}
    for m in mons.values():
        m._prepare()  # spectra and null frames once, outside the timing
    fwd()
    plain, timed = [], {name: [] for name in mons}
    for _ in range(args.reps):
        for name, m in mons.items():
            t0 = time.perf_counter()
            fwd()
            plain.append(time.perf_counter() - t0)
            with m:
                t0 = time.perf_counter()
                fwd()
                timed[name].append(time.perf_counter() - t0)
    base = min(plain)
    print(f"SmolLM2 4x128 forward, plain: {base:.3f} s (min of {len(plain)})")
    for name, ts in timed.items():
        print(f"  monitored, {name}: {min(ts):.3f} s  ratio {min(ts) / base:.3f}")


if __name__ == "__main__":
    main()
