"""How much slower the model's own kernels run beside the monitor, on generate_host.py's CPU proxy.

cProfile times each of the model's aten calls (``linear``, ``cat``, attention, the norms' ``mean`` ...)
in a plain and a monitored ``generate``, interleaved, and prints the medians of their own time (the
monitor's own calls of the same kernels left out by their callers). A difference is the model's
arithmetic slowed by what the monitor does beside it on a CPU whose caches the two share: its hooks'
Python, the readings it keeps, its flush. ``--width 128`` (~10 MiB of weights) against the default
256 (~37 MiB, past this machine's 32 MiB L3) asks whether the weights' fit matters. A GPU's host
touches neither the weights nor the readings, so this part of the CPU proxy's ratio is not a GPU's
(docs/scale.md, "Issue 39, third round"). cProfile's own overhead is in both columns.

Usage: PYTHONPATH=. python benchmarks/model_kernels.py [--width 256] [--rounds 6] [--quick] [--batch --prompt --new]   (from the repository root)
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import os
import pstats
import statistics
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import generate_host as G  # noqa: E402

KERNELS = ("linear", "cat", "scaled_dot_product_attention", "mean", "pow", "rsqrt", "silu")


def _own_times(model, kw) -> dict[str, float]:
    """Each kernel's own time (s) in one generate, by cProfile, when the model calls it (the monitor's
    own calls of the same kernels, its flush's ``cat``, left out by their callers)."""
    pr = cProfile.Profile()
    pr.enable()
    model.generate(**kw)
    pr.disable()
    out = dict.fromkeys(KERNELS, 0.0)
    for (_, _, name), (_, _, _, _, callers) in pstats.Stats(pr).stats.items():
        for k in KERNELS:
            if name.endswith(f".{k}>") or f"method '{k}'" in name:
                out[k] += sum([c[2] for (f, _, _), c in callers.items() if f"{os.sep}eigenhooks{os.sep}" not in f])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--quick", action="store_true", help="2 rounds of a short generate (a smoke run)")
    G.add_proxy_args(p)
    a = p.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    if a.quick:
        a.rounds, a.new = 2, 16
    import eigenhooks as eh

    model, kw = G.build(a)
    plain = copy.deepcopy(model)
    runs: dict[str, list[dict]] = {"plain": [], "monitored": []}
    with torch.no_grad(), eh.monitor(model):
        model.generate(**kw)
        plain.generate(**kw)
        for r in range(a.rounds):
            for name, m in (
                (("plain", plain), ("monitored", model)) if r % 2 == 0 else (("monitored", model), ("plain", plain))
            ):
                runs[name].append(_own_times(m, kw))
    n_params = sum(t.numel() for t in model.parameters())
    print(f"model kernels: generate_host.py's proxy at width {a.width} ({n_params * 4 / 2**20:.0f} MiB of float32 "
          f"weights), {a.batch} x ({a.prompt} + {a.new}), 1 thread, {a.rounds} interleaved rounds, cProfile")  # fmt: skip
    for k in KERNELS:
        tp = statistics.median([r[k] for r in runs["plain"]])
        tm = statistics.median([r[k] for r in runs["monitored"]])
        print(f"  {k:28s} plain {tp * 1e3:7.1f} ms  monitored {tm * 1e3:7.1f} ms  "
              f"{(tm / tp - 1) * 100 if tp else 0:+5.1f} %  {(tm - tp) / a.new * 1e6:+5.0f} us a step")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
