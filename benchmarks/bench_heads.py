"""What ``heads=True`` adds to SmolLM2's layer spectra, measured side by side (a benchmark, not a test).

Per-head and per-group spectra with vectors and the full OV circuit's copying score (W_Eᵀ W_U formed
once, then 64 x 64 eigenvalue problems per head): goal <= 10 s added to the 30 layers' spectra on 2
cores. Both sides run with ``cache=False`` (nothing from the memo or the disk), warm once, then
alternate for ``--rounds`` rounds; the added seconds and the ratio are of the medians, with the machine's
load printed (on a shared machine timings move).

Usage: python benchmarks/bench_heads.py [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from bench_spectrum import alternate, loadavg, min_ratio, ratio, show


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="cores the spectra may use (the goal is for 2)")
    args = ap.parse_args()
    import eigenhooks as eh

    os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[: args.threads]))  # eh.spectra sizes its pool by this
    torch.set_num_threads(args.threads)
    model, _ = eh.zoo.load("smollm2-135m")
    print(f"SmolLM2-135M, 30 layers, 9 heads / 3 kv groups; {args.threads} cores; load before {loadavg()}")
    t = alternate(
        args.rounds,
        layers=lambda: eh.spectra(model, cache=False),
        heads=lambda: eh.spectra(model, heads=True, cache=False),
    )
    added = statistics.median(t["heads"]) - statistics.median(t["layers"])
    print(show(t))
    print(
        f"heads=True adds {added:.2f} s (goal <= 10 s): heads / layers = {ratio(t, 'heads', 'layers'):.2f}x "
        f"(fastest runs {min_ratio(t, 'heads', 'layers'):.2f}x); load after {loadavg()}"
    )


if __name__ == "__main__":
    main()
