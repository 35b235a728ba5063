"""How wide the Haar null's 95% band is for a given number of null tokens, on the zoo's gpt2-tiny.

The monitor measures the null on its null tokens (``null_tokens``); on few tokens rho is a share of a
handful of counts and the band [null_rho_lo, null_rho_hi] spans most of [0, 1], so no verdict means
anything. This measures the band's width against the count: for each n, ``--windows`` windows of n
tokens of English prose and Python (the repository's own docs and code, read at fixed offsets), one
sequence each, measured at ``null_stride=1`` (so null_tokens = n) with the default 128 draws; the
width of every (layer, target) row. It prints, per n, the median and the largest width over the
rows and windows, and the smallest n from which the median row's band is at most 0.5 wide on every
window: ``stats.MIN_NULL_TOKENS`` is that figure (docs/concepts.md, "Too few tokens").

Usage: python benchmarks/null_band_width.py [--windows 8] [--sizes 4,6,8,10,12,14,16,20,24,32,48,64]
"""

from __future__ import annotations

import argparse
import statistics
import warnings
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--sizes", default="4,6,8,10,12,14,16,20,24,32,48,64")
    a = p.parse_args()
    import torch

    import eigenhooks as eh

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    model, tok = eh.zoo.load("gpt2-tiny")
    root = Path(__file__).resolve().parents[1]
    text = (root / "docs" / "concepts.md").read_text() + (root / "eigenhooks" / "monitor" / "stats.py").read_text()
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    sizes = [int(s) for s in a.sizes.split(",")]
    print("n  median width  largest width  windows whose median row is wider than 0.5")
    minimum = None
    for n in sizes:
        widths, wide = [], 0
        for w in range(a.windows):
            start = (w * 997) % (len(ids) - n)
            with eh.monitor(model, null_stride=1, fnull_draws=0, eig_top=0) as mon:
                model(input_ids=ids[None, start : start + n])
            df = mon.summary()
            assert (df["null_tokens"] == n).all()
            ww = (df["null_rho_hi"] - df["null_rho_lo"]).tolist()
            widths += ww
            wide += statistics.median(ww) > 0.5
        print(f"{n:3d}  {statistics.median(widths):.3f}  {max(widths):.3f}  {wide}/{a.windows}", flush=True)
        if wide == 0 and minimum is None:
            minimum = n
        elif wide:
            minimum = None
    print(f"smallest n from which every window's median row has a band <= 0.5 wide: {minimum}")


if __name__ == "__main__":
    main()
