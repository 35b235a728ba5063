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
import tempfile
import time

import torch


def best_of(fn, reps):
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def interleaved(fn, model, reps):
    """Best plain and best monitored time of fn, alternating so drift hits both alike."""
    import eigenhooks as eh

    fn()  # warm-up
    plain, monitored = [], []
    for _ in range(reps):
        plain.append(best_of(fn, 1))
        with eh.monitor(model):
            monitored.append(best_of(fn, 1))
    return min(plain), min(monitored)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tokens", type=int, default=50_000)
    p.add_argument("--mem-repeats", type=int, default=2)
    p.add_argument("--mem-only", action="store_true", help="only the memory measurement")
    p.add_argument("--_mem", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a._mem:
        return _mem_child(a._mem[0], int(a._mem[1]))
    os.environ.setdefault("EIGENHOOKS_CACHE", tempfile.mkdtemp(prefix="eh-bench-"))
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

    if not a.mem_only:
        plain, mon_t = interleaved(fwd, model, a.reps)
        r1 = mon_t / plain
        print(
            f"[1] batched forward 8x128: plain {plain:.3f} s, monitored {mon_t:.3f} s -> ratio {r1:.3f} (goal <= 1.05)"
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

        plain, mon_t = interleaved(gen, model, max(2, a.reps // 2))
        r2 = mon_t / plain
        print(
            f"[2] generation of 64 tokens: plain {plain:.3f} s, monitored {mon_t:.3f} s "
            f"-> ratio {r2:.3f} (goal <= 1.15)"
        )

    # Memory, two ways. (a) Peak transient: fresh processes run the same two batches plain and
    # monitored; a fixed mmap threshold and one malloc arena make glibc return freed tensors
    # at once, so the growth of peak RSS during the forwards is live memory (without them the
    # same run varies by +-150 MB here). (b) Retained state after 12.5k and 50k monitored
    # tokens: what the monitor keeps must not grow with the token count.
    import subprocess
    import sys

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_ARENA_MAX": "1"}
    grow = {"plain": float("inf"), "monitored": float("inf")}
    for mode in ("plain", "monitored") * a.mem_repeats:
        out = subprocess.run(
            [sys.executable, __file__, "--_mem", mode, "2048"], capture_output=True, text=True, check=True, env=env
        )
        grow[mode] = min(grow[mode], float(out.stdout.strip().splitlines()[-1]))
    print(
        f"[3a] peak RSS growth during two 8x128 forwards: plain {grow['plain']:.1f} MB, monitored "
        f"{grow['monitored']:.1f} MB -> extra {grow['monitored'] - grow['plain']:.1f} MB (goal <= 50 MB)"
    )
    import tracemalloc

    base_model = T.GPT2Model(T.GPT2Config(n_layer=12, n_embd=768, n_head=12)).eval()
    for tokens in (a.tokens // 4, a.tokens):
        tracemalloc.start()
        with eh.monitor(base_model) as mon, torch.no_grad():
            t0 = tracemalloc.get_traced_memory()[0]
            for _ in range(max(1, tokens // (8 * 128))):
                base_model(**batch)
            py_kept = tracemalloc.get_traced_memory()[0] - t0
            tensors = sum(t.numel() * t.element_size() for st in mon._acc.state.values() for t in st.values())
        tracemalloc.stop()
        n = int(mon.summary()["n_tokens"].iloc[0])
        print(
            f"[3b] after {n} monitored tokens the monitor keeps {(py_kept + tensors) / 2**20:.3f} MB "
            f"(Python objects traced in the process {py_kept / 2**20:.3f} MB + sums {tensors / 1024:.1f} KB)"
        )
    try:
        import transformer_lens as tl

        bridge = tl.TransformerBridge.boot_transformers("gpt2", hf_model=model, tokenizer=eh.zoo.load()[1])
        with torch.no_grad():
            _, cache = bridge.run_with_cache(ids)
        per_batch = sum(t.numel() * t.element_size() for t in cache.values())
        n_b = max(1, a.tokens // ids.numel())
        print(
            f"    TransformerLens run_with_cache on the same model holds {per_batch / 2**20:.0f} MB per 8x128 batch "
            f"(measured); keeping {n_b} batches' caches for {n_b * ids.numel()} tokens holds "
            f"{n_b * per_batch / 2**30:.1f} GB, growing with tokens, where the monitor keeps only sums"
        )
    except ImportError:
        print("    (TransformerLens not installed: run_with_cache comparison skipped)")


def _reset_peak() -> bool:
    """Reset this process's peak RSS (Linux: clear_refs 5), so the peak covers what follows."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_mb() -> float:
    import resource

    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _mem_child(mode: str, tokens: int) -> None:
    import transformers as T

    import eigenhooks as eh

    torch.manual_seed(0)
    # The bare model: the monitor reads residuals, and 50k-vocab logits would only add noise.
    model = T.GPT2Model(T.GPT2Config(n_layer=12, n_embd=768, n_head=12)).eval()
    ids = torch.randint(0, 50257, (8, 128))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        model(**batch)  # warm-up: allocator and kernels
    mon = eh.monitor(model) if mode == "monitored" else None
    if mon is not None:
        mon.__enter__()
    _reset_peak()  # measure the forward passes only, not model construction
    base = _peak_mb()  # right after the reset: the resident set the forwards start from
    with torch.no_grad():
        for _ in range(max(1, tokens // (8 * 128))):
            model(**batch)
    if mon is not None:
        mon.summary()  # the statistics are really computed
        mon.__exit__(None, None, None)
    print(_peak_mb() - base)  # growth of the peak during the forwards


if __name__ == "__main__":
    main()
