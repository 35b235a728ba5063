"""Monitor overhead, measured side by side in one run (not a timed test).

On a GPT-2-small-shaped model (12 x 768, random weights), prints:
  1. time ratio monitored / plain for a batched forward of 8 x 128 tokens (goal <= 1.05);
  2. the same ratio for token-by-token generation of 64 tokens (goal <= 1.15);
  3. extra peak memory for 50k monitored tokens (goal <= 50 MB, independent of the token
     count), next to what TransformerLens run_with_cache holds for the same tokens.

Usage: python benchmarks/bench_monitor.py [--reps 5] [--tokens 50000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import tracemalloc

import torch


def best_of(fn, reps):
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tokens", type=int, default=50_000)
    a = p.parse_args()
    os.environ["EIGENHOOKS_CACHE"] = tempfile.mkdtemp(prefix="eh-bench-")
    import transformers as T

    import eigenhooks as eh

    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257)).eval()
    eh.spectra(model, rank="modulus")
    eh.spectra(model, rank="residual")  # warm the cache: measure hooks, not eig
    ids = torch.randint(0, 50257, (8, 128))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def fwd():
        with torch.no_grad():
            model(**batch)

    fwd()
    # interleave plain and monitored runs so drift hits both alike
    plain, mon_t = [], []
    for _ in range(a.reps):
        plain.append(best_of(fwd, 1))
        with eh.monitor(model):
            mon_t.append(best_of(fwd, 1))
    r1 = statistics.median(mon_t) / statistics.median(plain)
    print(
        f"[1] batched forward 8x128: plain {statistics.median(plain):.3f} s, monitored {statistics.median(mon_t):.3f} s "
        f"-> ratio {r1:.3f} (goal <= 1.05)"
    )

    prompt = torch.randint(0, 50257, (1, 8))

    def gen():
        with torch.no_grad():
            model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=64,
                min_new_tokens=64,
                do_sample=False,
                pad_token_id=0,
            )

    gen()
    plain, mon_t = [], []
    for _ in range(max(2, a.reps // 2)):
        plain.append(best_of(gen, 1))
        with eh.monitor(model):
            mon_t.append(best_of(gen, 1))
    r2 = statistics.median(mon_t) / statistics.median(plain)
    print(
        f"[2] generation of 64 tokens: plain {statistics.median(plain):.3f} s, monitored {statistics.median(mon_t):.3f} s "
        f"-> ratio {r2:.3f} (goal <= 1.15)"
    )

    # Memory, side by side in this process: peak RSS after plain forwards, then the extra
    # peak while monitoring the same tokens (ru_maxrss only grows, so plain runs first),
    # plus the Python objects the monitor keeps (tracemalloc).
    import resource

    peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MB on Linux
    n_batches = max(1, a.tokens // (8 * 128))
    small = torch.randint(0, 50257, (8, 128))
    b2 = {"input_ids": small, "attention_mask": torch.ones_like(small)}
    with torch.no_grad():
        for _ in range(n_batches):
            model(**b2)
    plain_peak = peak()
    tracemalloc.start()
    with eh.monitor(model) as mon, torch.no_grad():
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(n_batches):
            model(**b2)
        kept = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    print(
        f"[3] {n_batches * 8 * 128} monitored tokens: extra peak RSS {peak() - plain_peak:.1f} MB over plain "
        f"(goal <= 50 MB); Python state kept by the monitor {kept / 2**20:.3f} MB for {len(mon.stats)} "
        "(layer, target) pairs, independent of the token count"
    )
    resid_bytes = a.tokens * 768 * 4 * (12 * 3 + 1)
    print(
        f"    TransformerLens run_with_cache would keep every activation: the residual stream alone "
        f"(resid_pre/mid/post x 12 layers, fp32) for {a.tokens} tokens is {resid_bytes / 2**20:.0f} MB "
        "(computed from shapes, not measured here)"
    )


if __name__ == "__main__":
    main()
