"""What entering ``eh.steer`` costs on SmolLM2, now against the previous code, paired.

On SmolLM2-135M (``eigenhooks fetch smollm2-135m`` first), alternating ``--rounds`` times, each
entry from an empty calibration memo (a first steer of the model):

- previous: the calibration of main at 1949967 (4 x 32 tokens, KV-cached: 31 decode steps of
  batch 4), i.e. ``calibration.sample_tokens(model, (4, 32))`` (memo lookup included), then
  ``eh.steer(model, u, calibration=ids)``;
- now: ``eh.steer(model, u)`` (``calibration.N_CALIBRATION``: 16 x 8, 7 decode steps of batch 16);
- with ``--plain``, also the code before 2026-12-06: 4 x 32 with a full forward at every step
  (``steer_calibration_check.old_sample_tokens``).

Prints each round's seconds, the medians, the median of the paired ratios previous / now, how
much of "now" is sampling, and the load average before and after (the machine is shared: read the
ratio, and rerun on a quiet machine for the absolute seconds). On a busy machine set
``OPENBLAS_NUM_THREADS=1`` too: numpy's eig in the spectra otherwise runs 2 threads that wait on
each other (seconds per entry, not the calibration's). Whether the calibration result moved is
``benchmarks/steer_calibration_check.py``'s question.

Usage: python benchmarks/bench_steer_entry.py [--threads 2] [--rounds 5] [--plain] [--word " Paris"]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

PREVIOUS_SHAPE = (4, 32)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--plain", action="store_true")
    p.add_argument("--word", default=" Paris")
    a = p.parse_args()
    from steer_calibration_check import load_smollm2, old_sample_tokens

    import eigenhooks as eh
    from eigenhooks.steer import calibration as C

    print(f"load average before: {os.getloadavg()}, {a.threads} threads, {os.cpu_count()} cores", flush=True)
    model, tok = load_smollm2(a.threads)
    u = eh.direction.token(model, tok, a.word)
    eh.steer(model, u, calibration=tok(["warm up"], return_tensors="pt")["input_ids"])  # code and allocator warm

    def previous():
        C._SAMPLES.clear()
        eh.steer(model, u, calibration=C.sample_tokens(model, PREVIOUS_SHAPE, progress=False))

    def now():
        C._SAMPLES.clear()
        eh.steer(model, u, progress=False)

    def sampling():
        C._SAMPLES.clear()
        C.sample_tokens(model, progress=False)

    cases = {"previous": previous, "now": now}
    if a.plain:
        cases["plain"] = lambda: eh.steer(model, u, calibration=old_sample_tokens(model, 0))
    times: dict[str, list[float]] = {k: [] for k in [*cases, "sampling"]}
    for r in range(a.rounds):
        order = list(cases) if r % 2 == 0 else list(cases)[::-1]  # alternate who goes first
        for k in order:
            times[k].append(_timed(cases[k]))
        times["sampling"].append(_timed(sampling))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = statistics.median(p / n for p, n in zip(times["previous"], times["now"]))
    print(
        f"entry, median of {a.rounds}: "
        + ", ".join(f"{k} {med[k]:.2f} s" for k in cases)
        + f"; paired previous/now {ratio:.2f}x; of now, sampling {med['sampling']:.2f} s"
    )
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
