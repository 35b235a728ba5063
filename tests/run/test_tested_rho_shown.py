"""The table and the plot show the rho the verdict tests, not only rho on all tokens.

The null is measured on every null_stride-th token of each sequence, and p_null, pct and the verdict
compare the target's rho on those same tokens (``rho_null_tokens``). On few tokens it can stand apart
from rho on all of them: on the notebook's four texts, layer 0 read rho 0.667 inside the band
0.16-0.86 with the verdict "toward", because rho on the null's 14 tokens was 0.93.
"""

from __future__ import annotations

import pytest
import torch

import eigenhooks as eh
from eigenhooks.run.table import RUN_COLUMNS, rows

TEXTS = [
    "def add(a, b):\n    return a + b",
    "A class statement defines a class object.",
    "The with statement wraps a block with methods of a context manager.",
    "for x in range(10):\n    print(x)",
]


def _summary(**kw):
    model, tok = eh.zoo.load("gpt2-tiny")
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    with eh.monitor(model, **kw) as mon, torch.no_grad():
        model(**batch)
    return mon.summary()


@pytest.fixture(scope="module")
def few_tokens():
    return _summary()


def _band_cells(df):
    heads, cells = rows(df)
    col = heads.index(next(h for h, _ in RUN_COLUMNS if h.startswith("null ρ 95%")))
    return [c[col] for c in cells]


def test_the_band_cell_carries_the_tested_rho(few_tokens):
    df = few_tokens
    assert (df["null_tokens"] < df["n_tokens"]).all()
    for cell, r in zip(_band_cells(df), df.to_dict("records")):
        assert cell == f"{r['null_rho_lo']:.2f}–{r['null_rho_hi']:.2f} ({r['rho_null_tokens']:.2f})", cell


def test_every_verdict_stands_outside_the_band_by_the_tested_rho(few_tokens):
    for r in few_tokens.to_dict("records"):
        if r["verdict"] == "toward":
            assert r["rho_null_tokens"] >= r["null_rho_hi"], r
        elif r["verdict"] == "away":
            assert r["rho_null_tokens"] <= r["null_rho_lo"], r


def test_no_brackets_when_the_null_saw_every_token():
    df = _summary(null_stride=1)
    assert (df["null_tokens"] == df["n_tokens"]).all()
    assert all("(" not in c for c in _band_cells(df))


def test_the_plot_rings_the_tested_rho_and_marks_the_verdict_on_it():
    # a summary written out, so the plot is checked whatever a model's numbers are in this environment
    pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install 'eigenhooks[plot]')")
    import pandas as pd

    from eigenhooks import plots

    nan = float("nan")
    rows = [  # layer 0 is the notebook's case: rho inside the band, the tested rho above it
        dict(layer=0, rho=0.667, rho_null_tokens=0.929, verdict="toward"),
        dict(layer=1, rho=0.45, rho_null_tokens=0.50, verdict="indistinguishable"),
        dict(layer=2, rho=0.30, rho_null_tokens=0.08, verdict="away"),
    ]
    for r in rows:
        r.update(target="ov/modulus", n_tokens=60, null_tokens=14, rho_ci_lo=r["rho"] - 0.1, rho_ci_hi=r["rho"] + 0.1)
        r.update(null_rho_lo=0.16, null_rho_hi=0.86, null_rho_mean=0.5, gamma_pre=0.1, gamma_mid=0.1)
        r.update(null_gamma_pre_lo=0.05, null_gamma_pre_hi=0.15, q_null=nan)
    for r, t in zip(rows, (0.03, 0.001, -0.02)):  # the verdict's test: Δγ against the stream's directions
        r.update(tilt=t, tilt_ci_lo=t - 0.005, tilt_ci_hi=t + 0.005, tilt_null_lo=-0.01, tilt_null_hi=0.01)
        r.update(tilt_null_median=0.0)
    df = pd.DataFrame(rows)
    fig = plots.alignment_by_layer(df, "modulus")  # Δγ on top, then rho, then gamma
    tilt, ax = fig.axes[0], fig.axes[1]
    by_label = {c.get_label(): [tuple(p) for p in c.get_offsets()] for c in ax.collections}
    assert by_label["ρ on the null's tokens"] == [(0, 0.929), (1, 0.50), (2, 0.08)]
    assert "toward (q < 0.05)" not in by_label  # rho does not decide the verdict: no marker there
    marks = {c.get_label(): [tuple(p) for p in c.get_offsets()] for c in tilt.collections}
    assert marks["toward (q < 0.05)"] == [(0, 0.03)] and marks["away (q < 0.05)"] == [(2, -0.02)]
