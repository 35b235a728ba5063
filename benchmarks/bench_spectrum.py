"""Spectrum speed, measured side by side in one run (a benchmark, not a timed test).

Prints, on a Llama-8B-shaped attention layer (d=4096, 32 query heads, 8 kv heads x 128,
random weights; a one-layer LlamaForCausalLM with a tiny MLP and vocabulary):
  1. numpy ``eigvals`` of the dense d x d F = O V against ``eh.spectra`` (all d eigenvalues
     and the leading eigenvectors) and ``eh.layer_spectrum``: ratio goal >= 10x;
  2. a repeat ``eh.spectra`` call in the same process against the first (empty disk cache):
     ratio goal >= 20x; the disk-cache hit of a fresh process is shown for context;
then the same two figures for a GPT-2-small-shaped model (12 x 768, goal <= 5 s in all).

Each side is warmed up once (LAPACK's first call in a process pays a one-off set-up), then
the two sides alternate for ``--rounds`` rounds; every ratio is of the medians, and the
minima are printed too. The machine's load is printed: on a shared machine timings move.

Usage: python benchmarks/bench_spectrum.py [--rounds 3] [--skip-dense] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import torch


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def llama8b_layer_model(seed: int = 0):
    """One Llama-8B-shaped attention layer inside a real HF model (MLP and vocab kept tiny)."""
    import transformers as T

    cfg = T.LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=64,
        num_hidden_layers=1,
        vocab_size=64,
    )
    with torch.device("meta"):
        model = T.LlamaForCausalLM(cfg)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model.eval()


def alternate(rounds: int, **sides) -> dict[str, list[float]]:
    """Run each side once to warm up, then alternate them; seconds per side and round."""
    for fn in sides.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(rounds):
        for k, fn in sides.items():
            times[k].append(timed(fn)[0])
    return times


def show(times: dict[str, list[float]]) -> str:
    return ", ".join(f"{k} median {statistics.median(v):.3f} s (min {min(v):.3f})" for k, v in times.items())


def ratio(times, a: str, b: str) -> float:
    return statistics.median(times[a]) / statistics.median(times[b])


def min_ratio(times, a: str, b: str) -> float:
    """Ratio of the fastest runs: on a shared machine, the least disturbed of each side."""
    return min(times[a]) / max(min(times[b]), 1e-9)


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def first_vs_repeat(model, rounds: int) -> dict[str, list[float]]:
    """First call on an empty disk cache and memo, the in-process repeat, and a disk-cache hit."""
    import eigenhooks as eh
    from eigenhooks.spectra import clear_memo

    out: dict[str, list[float]] = {"first": [], "repeat": [], "disk_hit": []}
    for _ in range(rounds):
        os.environ["EIGENHOOKS_CACHE"] = tempfile.mkdtemp(prefix="eh-bench-")
        clear_memo()
        out["first"].append(timed(lambda: eh.spectra(model))[0])
        out["repeat"].append(min(timed(lambda: eh.spectra(model))[0] for _ in range(3)))
        clear_memo()  # what a fresh process sees: the content-keyed disk cache
        out["disk_hit"].append(timed(lambda: eh.spectra(model))[0])
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--skip-dense", action="store_true", help="skip numpy eigvals of the dense F (slow)")
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    os.environ["EIGENHOOKS_CACHE"] = tempfile.mkdtemp(prefix="eh-bench-")
    import transformers as T

    import eigenhooks as eh

    load = os.getloadavg()
    print(
        f"torch {torch.__version__}, numpy {np.__version__}, threads {torch.get_num_threads()}, cpus {os.cpu_count()}"
    )
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")

    model = llama8b_layer_model()
    factors = eh.get_adapter(model).factors(0)
    F = factors.matrix().numpy()  # (4096, 4096) float64, built once, outside the timings
    print(f"[1] Llama-8B-shaped layer: d={F.shape[0]}, 32 q heads, 8 kv heads x 128 (small side 1024 x 1024)")
    sides = {
        "eh.spectra": lambda: eh.spectra(model, cache=False),
        "eh.layer_spectrum": lambda: eh.layer_spectrum(factors),
    }
    if not a.skip_dense:
        sides = {"numpy eigvals(F)": lambda: np.linalg.eigvals(F), **sides}
    t1 = alternate(a.rounds, **sides)
    print(f"    {show(t1)}")
    if not a.skip_dense:
        print(
            f"    ratio numpy eigvals / eh.spectra = {ratio(t1, 'numpy eigvals(F)', 'eh.spectra'):.1f}x, "
            f"/ eh.layer_spectrum = {ratio(t1, 'numpy eigvals(F)', 'eh.layer_spectrum'):.1f}x (goal >= 10x); "
            f"of the minima {min_ratio(t1, 'numpy eigvals(F)', 'eh.spectra'):.1f}x and "
            f"{min_ratio(t1, 'numpy eigvals(F)', 'eh.layer_spectrum'):.1f}x; load {loadavg()}"
        )
    t2 = first_vs_repeat(model, a.rounds)
    print(f"[2] same model, eh.spectra: {show(t2)}")
    print(
        f"    ratio first / in-process repeat = {ratio(t2, 'first', 'repeat'):.0f}x (goal >= 20x); "
        f"first / disk-cache hit = {ratio(t2, 'first', 'disk_hit'):.1f}x; of the minima "
        f"{min_ratio(t2, 'first', 'repeat'):.0f}x and {min_ratio(t2, 'first', 'disk_hit'):.1f}x; load {loadavg()}"
    )
    model = factors = F = None  # free the 8B-shaped layer before the next part

    torch.manual_seed(0)
    gpt2 = T.GPT2LMHeadModel(T.GPT2Config(n_layer=12, n_embd=768, n_head=12)).eval()
    t3 = first_vs_repeat(gpt2, a.rounds)
    print(f"[3] GPT-2-small-shaped model, 12 x 768: {show(t3)} (goal: first <= 5 s)")
    print(
        f"    ratio first / in-process repeat = {ratio(t3, 'first', 'repeat'):.0f}x (goal >= 20x); "
        f"of the minima {min_ratio(t3, 'first', 'repeat'):.0f}x; load {loadavg()}"
    )
    load = os.getloadavg()
    print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
