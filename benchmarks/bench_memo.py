"""What a repeat ``eh.spectra`` call costs on SmolLM2-135M (30 layers, 576 wide, 9 q / 3 kv heads).

A repeat call in the same process is answered by the in-process memo. Its key must say which
weights the spectrum belongs to; since issue 41 it is a hash of every byte of the layer's O, V and
norm (``weights_digest``; SHA-256 until issue 52, xxh3-128 since), so the repeat hashes the
attention weights once per layer.
Prints, alternated for ``--rounds`` rounds after a warm-up (medians and minima):

  repeat     ``eh.spectra(model)`` again (the memo answers)
  disk_hit   the same after ``clear_memo()`` (what a fresh process sees: the disk cache answers)
  digest     the memo's digest of every layer, one after another (the hashing in ``repeat``)

Run it against two checkouts (PYTHONPATH) to compare keys; the machine's load is printed.

Usage: python benchmarks/bench_memo.py [--rounds 7] [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--model", default="smollm2-135m")
    a = p.parse_args()
    import eigenhooks as eh
    from eigenhooks.spectra import clear_memo, memo

    model, _ = eh.zoo.load(a.model)
    os.environ["EIGENHOOKS_CACHE"] = tempfile.mkdtemp(prefix="eh-bench-")  # loaded first: spectra in a fresh folder
    ad = eh.get_adapter(model)
    t = time.perf_counter()
    eh.spectra(model)
    first = time.perf_counter() - t

    def repeat():
        eh.spectra(model)

    def disk_hit():
        clear_memo()
        eh.spectra(model)

    def digest():
        for i in range(ad.n_layers):
            memo.digest(ad, i)

    sides = {"repeat": repeat, "disk_hit": disk_hit, "digest": digest}
    for fn in sides.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in sides}
    load = os.getloadavg()
    for _ in range(a.rounds):
        for k, fn in sides.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    print(f"{a.model}: {ad.n_layers} layers, first call {first:.2f} s (empty disk cache and memo)")
    for k, v in times.items():
        print(f"  {k:9s} median {1e3 * statistics.median(v):7.1f} ms  min {1e3 * min(v):7.1f} ms")
    print(f"load average before {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
