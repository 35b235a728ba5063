"""What entering ``eh.steer`` costs on SmolLM2: cold (no calibration sample kept) against warm (kept on disk).

On SmolLM2-135M (``eigenhooks fetch smollm2-135m`` first), ``eh.steer(model, u)`` at its defaults
(layer -1, signed, calibrated on 16 x 8 tokens the model samples itself, ``calibration.N_CALIBRATION``):

- cold: a first steer of these weights ever: no in-process memo, no sample on disk (an empty
  ``EIGENHOOKS_CACHE``), so the entry samples 7 decode steps;
- warm: a later process's first steer: no in-process memo, the sample on disk from an earlier one;
- sampling: ``calibration._sample`` alone (what cold pays and warm does not);
- with ``--previous``, also the 4 x 32 sample before 2026-12-06 (31 KV-cached steps), as a reference.

In-process rounds (``--rounds``, alternating who goes first, after one warm-up steer that warms the code
and the allocator) give paired ratios. ``--fresh N`` also starts N new processes for each of cold and
warm, alternated, each timing only its first entry (the model loaded first, untimed): the entry a user
meets, first-call costs included. Prints each time, the medians, and the load average before and after
(the machine is shared: rerun quiet for absolute seconds). ``OPENBLAS_NUM_THREADS=1`` pins numpy's
OpenBLAS (the spectra's eig) to one thread: on a busy machine its second thread waits on a descheduled
one. Whether the calibration result moved is ``benchmarks/steer_calibration_check.py``'s question.

Usage: python benchmarks/bench_steer_entry.py [--threads 2] [--rounds 5] [--fresh 3] [--previous]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PREVIOUS_SHAPE = (4, 32)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _load(threads: int):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from steer_calibration_check import load_smollm2

    import eigenhooks as eh

    model, tok = load_smollm2(threads)
    return eh, model, eh.direction.token(model, tok, " Paris")


def first_entry(threads: int) -> None:
    """A fresh process's first entry (``--child``): print its seconds."""
    eh, model, u = _load(threads)
    print(f"{_timed(lambda: eh.steer(model, u, progress=False)):.4f}")


def fresh(threads: int, n: int) -> dict[str, list[float]]:
    """n new processes for each of cold (an empty cache folder) and warm (the folder a cold one left)."""
    times: dict[str, list[float]] = {"cold": [], "warm": []}
    kept = Path(tempfile.mkdtemp(prefix="eh-steer-kept-"))
    try:
        for r in range(n):
            for case in ("cold", "warm") if r % 2 == 0 else ("warm", "cold"):
                folder = Path(tempfile.mkdtemp(prefix="eh-steer-cache-"))
                if case == "warm":
                    if not (kept / "calibration").is_dir():  # the first warm run needs an earlier cold one's sample
                        subprocess.run([sys.executable, __file__, "--child", "--threads", str(threads)],
                                       env={**os.environ, "EIGENHOOKS_CACHE": str(kept)}, check=True,
                                       capture_output=True)  # fmt: skip
                    shutil.copytree(kept / "calibration", folder / "calibration")
                out = subprocess.run(
                    [sys.executable, __file__, "--child", "--threads", str(threads)],
                    env={**os.environ, "EIGENHOOKS_CACHE": str(folder)}, capture_output=True, text=True,
                )  # fmt: skip
                if out.returncode:
                    raise RuntimeError(f"a {case} process failed:\n{out.stderr[-3000:]}")
                times[case].append(float(out.stdout.strip().splitlines()[-1]))
                shutil.rmtree(folder, ignore_errors=True)
            print(f"fresh process {r}: cold {times['cold'][-1]:.2f} s, warm {times['warm'][-1]:.2f} s", flush=True)
    finally:
        shutil.rmtree(kept, ignore_errors=True)
    return times


def in_process(threads: int, rounds: int, previous: bool) -> dict[str, list[float]]:
    eh, model, u = _load(threads)
    from eigenhooks.linalg.cache import CALIBRATION_DIR, cache_dir
    from eigenhooks.steer import calibration as C

    eh.steer(model, u, calibration=C._sample(model, (2, 2), 0, cached=True, progress=False))  # code, allocator warm

    def cold():
        C._SAMPLES.clear()
        shutil.rmtree(cache_dir() / CALIBRATION_DIR, ignore_errors=True)
        eh.steer(model, u, progress=False)

    def warm():  # the sample cold left on disk
        C._SAMPLES.clear()
        eh.steer(model, u, progress=False)

    cases = {"cold": cold, "warm": warm}
    if previous:
        cases["previous"] = lambda: eh.steer(model, u, calibration=C._sample(model, PREVIOUS_SHAPE, 0, True, False))
    times: dict[str, list[float]] = {k: [] for k in [*cases, "sampling"]}
    for r in range(rounds):
        order = ["warm", "cold"] if r % 2 else ["cold", "warm"]  # round 0 cold first: warm reads its sample
        for k in order + [k for k in cases if k not in order]:
            times[k].append(_timed(cases[k]))
        times["sampling"].append(_timed(lambda: C._sample(model, C.N_CALIBRATION, 0, True, False)))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True)
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--fresh", type=int, default=0, help="also N new processes each for cold and warm")
    p.add_argument("--previous", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return first_entry(a.threads)
    blas = os.environ.get("OPENBLAS_NUM_THREADS", "unset")
    print(f"load average before: {os.getloadavg()}, {a.threads} threads, OPENBLAS_NUM_THREADS={blas}, "
          f"{os.cpu_count()} cores", flush=True)  # fmt: skip
    from eigenhooks.zoo import real

    os.environ.setdefault("EIGENHOOKS_MODELS", str(real.models_dir()))  # the fetched model stays where it is
    with tempfile.TemporaryDirectory(prefix="eh-steer-bench-") as folder:
        os.environ["EIGENHOOKS_CACHE"] = folder  # never the user's cache: cold must be cold
        times = in_process(a.threads, a.rounds, a.previous) if a.rounds else {}
    med = {k: statistics.median(v) for k, v in times.items()}
    if times:
        ratio = statistics.median(c / w for c, w in zip(times["cold"], times["warm"]))
        print(f"in process, median of {a.rounds}: " + ", ".join(f"{k} {v:.2f} s" for k, v in med.items())
              + f"; paired cold/warm {ratio:.2f}x")  # fmt: skip
    if a.fresh:
        ft = fresh(a.threads, a.fresh)
        print(f"fresh processes, median of {a.fresh}: first entry cold {statistics.median(ft['cold']):.2f} s "
              f"(each {', '.join(f'{x:.2f}' for x in ft['cold'])}), warm {statistics.median(ft['warm']):.2f} s "
              f"(each {', '.join(f'{x:.2f}' for x in ft['warm'])})")  # fmt: skip
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
