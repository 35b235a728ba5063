"""Spectrum speed, measured side by side in one run (not a timed test).

Prints:
  1. dense eig vs the small side on a Llama-8B-shaped layer (d=4096, 32 query heads,
     8 kv heads x 128): the ratio dense / small-side (goal >= 10x);
  2. seconds for all 12 layers of a GPT-2-small-shaped model (12 x 768; goal <= 5 s);
  3. the cache's speed-up on a second call for the same model (goal >= 20x).

Usage: python benchmarks/bench_spectrum.py [--d 4096] [--skip-dense]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def gqa_layer(d, H, G, dh, seed=0):
    from eigenhooks import Factors

    g = torch.Generator().manual_seed(seed)
    O = torch.randn(d, H * dh, generator=g, dtype=torch.float64) / d**0.5
    V = torch.randn(G * dh, d, generator=g, dtype=torch.float64) / d**0.5
    return Factors.from_stacked(O, V, H, G)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--d", type=int, default=4096)
    p.add_argument("--skip-dense", action="store_true")
    a = p.parse_args()
    os.environ["EIGENHOOKS_CACHE"] = tempfile.mkdtemp(prefix="eh-bench-")
    import transformers as T

    import eigenhooks as eh
    from eigenhooks.spectrum import eig_factored

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    d = a.d
    H, G, dh = 32, 8, d // 32
    f = gqa_layer(d, H, G, dh)
    t_small, spec = timed(lambda: eh.layer_spectrum(f))
    print(
        f"[1] Llama-8B-shaped layer d={d}, {H} q heads, {G} kv heads x {dh}: small side {t_small:.2f} s "
        f"(eig of {G * dh}x{G * dh})"
    )
    if not a.skip_dense:
        O, V = f.stacked()
        F = O @ V
        # The dense path as it would run without the trick: eig of the full d x d matrix.
        t_dense, _ = timed(lambda: eig_factored(F, torch.eye(d, dtype=torch.float64)))
        print(
            f"    dense eig of {d}x{d}: {t_dense:.2f} s  ->  ratio dense / small-side = {t_dense / t_small:.1f}x (goal >= 10x)"
        )

    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(n_layer=12, n_embd=768, n_head=12)).eval()
    t_all, specs = timed(lambda: eh.spectra(model, cache=False))
    print(
        f"[2] GPT-2-small-shaped model, 12 x 768: all layers in {t_all:.2f} s (goal <= 5 s), "
        f"{t_all / 12:.2f} s per layer"
    )
    t_cold, _ = timed(lambda: eh.spectra(model))
    t_warm, _ = timed(lambda: eh.spectra(model))
    print(
        f"[3] cache: first call {t_cold:.2f} s, second call {t_warm:.3f} s -> speed-up {t_cold / t_warm:.0f}x (goal >= 20x)"
    )


if __name__ == "__main__":
    main()
