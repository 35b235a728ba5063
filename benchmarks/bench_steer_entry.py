"""What entering ``eh.steer`` costs on a real model, and whether the KV-cached calibration changes it.

On SmolLM2-135M (``eigenhooks fetch smollm2-135m`` first), alternating ``--rounds`` times:

- old: the plain twin (``calibration.sample_tokens_plain``: 31 full forwards over the growing
  prefix, the code before the KV cache) then ``eh.steer(model, u, calibration=ids)``;
- new: ``eh.steer(model, u)`` with the sampler's memo emptied (KV cache: one token per forward).

Prints each round's seconds and the medians and their ratio. Then, for ``--seeds`` seeds, the
calibrated strength alpha and lambda from each sampler's text: the same sign, and the new mean
within 3 standard errors (over the seeds) of the old one, the issue's bar.

Usage: python benchmarks/bench_steer_entry.py [--threads 2] [--rounds 3] [--seeds 5] [--word " Paris"]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import warnings


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--word", default=" Paris")
    a = p.parse_args()
    import torch

    import eigenhooks as eh
    from eigenhooks.steer import calibration as C

    warnings.simplefilter("ignore")
    torch.set_num_threads(a.threads)
    model, tok = eh.zoo.load("smollm2-135m")
    u = eh.direction.token(model, tok, a.word)
    eh.steer(model, u, calibration=tok(["warm up"], return_tensors="pt")["input_ids"])  # spectra cached, code warm

    times = {"old": [], "new": []}
    for r in range(a.rounds):
        t = time.perf_counter()
        eh.steer(model, u, calibration=C.sample_tokens_plain(model))
        times["old"].append(time.perf_counter() - t)
        C._SAMPLES.clear()
        t = time.perf_counter()
        eh.steer(model, u, progress=False)
        times["new"].append(time.perf_counter() - t)
        print(f"round {r}: old {times['old'][-1]:.2f} s, new {times['new'][-1]:.2f} s", flush=True)
    mo, mn = statistics.median(times["old"]), statistics.median(times["new"])
    print(f"entry, median of {a.rounds} ({a.threads} threads): old {mo:.2f} s, new {mn:.2f} s, old/new {mo / mn:.1f}x")

    old, new = [], []
    for seed in range(a.seeds):
        so = eh.steer(model, u, calibration=C.sample_tokens_plain(model, seed=seed))
        C._SAMPLES.clear()
        sn = eh.steer(model, u, calibration=C.sample_tokens(model, seed=seed, progress=False))
        same = (
            torch.equal(C.sample_tokens_plain(model, seed=seed), C.sample_tokens(model, seed=seed))
            if seed == 0
            else None
        )
        old.append((so.alpha, so.change.lam))
        new.append((sn.alpha, sn.change.lam))
        print(
            f"seed {seed}: alpha old {so.alpha:.6g} new {sn.alpha:.6g}; lambda old {so.change.lam:.6g} "
            f"new {sn.change.lam:.6g}" + ("" if same is None else f"; seed 0's samples equal: {same}"),
            flush=True,
        )
    ao, an = [o[0] for o in old], [n[0] for n in new]
    se = statistics.stdev(ao) / math.sqrt(len(ao)) if len(ao) > 1 else float("nan")
    signs = all(math.copysign(1, o[1]) == math.copysign(1, n[1]) for o, n in zip(old, new))
    diff = abs(statistics.mean(an) - statistics.mean(ao))
    print(
        f"alpha mean old {statistics.mean(ao):.6g} new {statistics.mean(an):.6g}, |diff| {diff:.3g}, "
        f"3 SE {3 * se:.3g}: {'within' if diff <= 3 * se else 'OUTSIDE'}; same sign of lambda: {signs}"
    )


if __name__ == "__main__":
    main()
