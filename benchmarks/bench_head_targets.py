"""Head targets' cost on SmolLM2 (issue 42, item 5): the forward with layer and head targets vs plain.

    python benchmarks/bench_head_targets.py [--reps 11] [--threads 2]

SmolLM2-135M (30 layers, 9 query heads, 3 kv groups), a 4x128 forward, interleaved with the plain
forward (``bench_monitor_real.interleaved``): each monitored run over the mean of the plain runs
just before and after it, whose median is the figure (goal <= 1.10 for layer + head targets).
Monitors, default null settings:

- layer targets only (the default ``("ov", "modulus"), ("ov", "residual")``);
- layer targets + ``("ov_head", "modulus")`` (270 head rows);
- layer targets + both head ranks (540 head rows).

Also each monitor's own time inside the forward (``bench_monitor_real.print_own``: its hooks and
reduction timed directly, as a share of the plain forward), and the load average before and after (the machines are shared: read the ratios beside it). Needs
`eigenhooks fetch smollm2-135m`. Not a timed test.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_monitor_real import interleaved, print_own, report  # noqa: E402

import eigenhooks as eh  # noqa: E402

LAYERS = [("ov", "modulus"), ("ov", "residual")]
CONFIGS = {
    "layer targets only": LAYERS,
    "layer + ov_head/modulus": LAYERS + [("ov_head", "modulus")],
    "layer + ov_head/modulus + ov_head/residual": LAYERS + [("ov_head", "modulus"), ("ov_head", "residual")],
}
GOAL = 1.10


def main() -> None:
    import statistics

    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = eh.zoo.load("smollm2-135m")
    ids = torch.randint(100, 20000, (4, 128), generator=torch.Generator().manual_seed(0))

    def fwd():
        with torch.no_grad():
            model(input_ids=ids)

    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} cores)")
    mons = {name: eh.monitor(model, targets=t) for name, t in CONFIGS.items()}
    base, timed, pairs = interleaved(fwd, mons, args.reps)
    report(f"SmolLM2 4x128 forward, {args.threads} threads", base, timed, pairs)
    for name, mon in mons.items():
        rows = len(mon.summary())
        med = statistics.median(pairs[name])
        goal = f"  goal <= {GOAL:.2f}: {'met' if med <= GOAL else 'NOT met'}" if "head" in name else ""
        print(f"  {name}: {rows} summary rows, median paired ratio {med:.3f}{goal}")
    # the monitor's own time inside the forward (its hooks and reduction, timed directly): steadier than
    # a ratio of two wall times on a shared machine
    print_own({name: eh.monitor(model, targets=t) for name, t in CONFIGS.items()}, fwd, args.reps)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
