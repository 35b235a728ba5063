"""What holding a decoding step's readings costs the CPU proxy, with no monitor at all.

The monitor keeps each one-token step's readings (references, no copy) until its flush reduces
them, 64 steps at a time on ``generate_host.py``'s proxy. This script asks what that holding costs
by itself. It runs the same generate interleaved under five sets of hooks, with the same 33 hooks
on the same modules as the monitor (each layer and its post-attention norm), and times the thread's
CPU:

- plain: no hooks;
- noop: hooks that do nothing (torch's hooked call path);
- keep: hooks that keep a reference to their input, dropped every 64 steps (the monitor's buffer);
- keep8: the same, dropped every 8 steps;
- copy: hooks that copy their input into one preallocated ring of 64 steps.

It prints the median thread CPU time of each, its ratio to plain, and keep - noop per step. On a
CPU the kept readings hold fresh memory out of the allocator's reuse, so the model's next tensors
land in colder memory. A GPU's host does not touch that data, so this part of the CPU proxy's
ratio says little about a GPU's decoding step (docs/scale.md, "Issue 39").

Usage: PYTHONPATH=. python benchmarks/kept_readings.py [--rounds 15] [--quick]   (from the repository root)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import generate_host as G  # noqa: E402

MODES = ("plain", "noop", "keep", "keep8", "copy")
STEPS = 64  # the monitor's buffer on this proxy: BUFFER_TOKENS / 4 rows


def hooks(model, batch: int, width: int) -> dict:
    """Each mode's pre-hook (with kwargs), and what it holds."""
    n = 2 * len(model.model.layers) + 1
    kept: list = []
    ring = torch.empty(STEPS * n, batch, 1, width)
    at = [0]

    def reading(args, kwargs):
        x = kwargs.get("hidden_states", args[0] if args else None)
        return x[0] if isinstance(x, tuple | list) else x

    def keep(steps):
        def fn(module, args, kwargs):
            kept.append(reading(args, kwargs))
            if len(kept) >= steps * n:
                kept.clear()

        return fn

    def copy(module, args, kwargs):
        x = reading(args, kwargs)
        if x.shape[1] == 1:
            ring[at[0]].copy_(x)
            at[0] = (at[0] + 1) % len(ring)

    return {"noop": lambda module, args, kwargs: None, "keep": keep(STEPS), "keep8": keep(8), "copy": copy}, kept


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="2 rounds of a short generate (a smoke run)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    shape = argparse.Namespace(batch=4, prompt=16, new=16 if args.quick else 128)
    rounds = 2 if args.quick else args.rounds
    model, kw = G.build(shape)
    fns, kept = hooks(model, shape.batch, G.SHAPE["hidden_size"])
    mods = [m for layer in model.model.layers for m in (layer, layer.post_attention_layernorm)] + [model.model.norm]

    def run(mode: str) -> float:
        handles = [m.register_forward_pre_hook(fns[mode], with_kwargs=True) for m in mods] if mode in fns else []
        kept.clear()
        t = time.thread_time()
        with torch.no_grad():
            model.generate(**kw)
        t = time.thread_time() - t
        for h in handles:
            h.remove()
        return t

    run("plain")
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(rounds):
        for mode in MODES if r % 2 else MODES[::-1]:
            times[mode].append(run(mode))
    med = {m: statistics.median(v) for m, v in times.items()}
    print(f"kept readings: generate_host.py's proxy, {shape.batch} x ({shape.prompt} + {shape.new}), 1 thread, "
          f"{rounds} interleaved rounds, {len(mods)} pre-hooks")  # fmt: skip
    for m in MODES:
        print(f"  {m:6s} median {med[m] * 1e3:8.1f} ms  ratio to plain {med[m] / med['plain']:.3f}")
    print(f"  keep - noop: {(med['keep'] - med['noop']) / shape.new * 1e6:.0f} us a step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
