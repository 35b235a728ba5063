"""What the monitor tests share: a padded gpt2-tiny batch, two summaries compared column by column, and
Benjamini-Hochberg written out by hand."""

import numpy as np
import torch

import eigenhooks as eh


def padded_gpt2_summary(null_stride: int = 3):
    """A function that runs gpt2-tiny on a right-padded batch of two under a fresh monitor: (monitor, summary)."""
    model, tok = eh.zoo.load("gpt2-tiny")
    tok.pad_token = tok.eos_token
    batch = tok(["def f(x):\n    return x + 1", "import os"], return_tensors="pt", padding=True)

    def run():
        with eh.monitor(model, null_stride=null_stride) as mon, torch.no_grad():
            model(**batch)
        return mon, mon.summary()

    return run


def assert_same_summary(got, want, rel: float) -> None:
    """Every column: counts and words equal, floats to ``rel`` (absolute and relative), NaN where NaN."""
    assert list(got.columns) == list(want.columns)
    for c in want.columns:
        if want[c].dtype.kind in "fc":
            ok = (got[c] - want[c]).abs() <= rel + rel * want[c].abs()
            assert ok.where(want[c].notna(), True).all(), c
            assert (got[c].isna() == want[c].isna()).all(), c
        else:
            assert (got[c] == want[c]).all(), c


def bh_by_hand(p):
    """Benjamini-Hochberg written out (step-up), numpy only."""
    p = np.asarray(p, float)
    m, order = p.size, np.argsort(p)
    q = np.empty(m)
    running = 1.0
    for rank in range(m, 0, -1):
        i = order[rank - 1]
        running = min(running, p[i] * m / rank)
        q[i] = running
    return q
