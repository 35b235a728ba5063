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
    # the case that misled: rho on all tokens inside the band, the verdict "toward" from the tested rho
    apart = df[(df["rho"] < df["null_rho_hi"]) & (df["verdict"] == "toward")]
    assert len(apart) and (apart["rho_null_tokens"] >= apart["null_rho_hi"]).all()


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


def test_the_plot_rings_the_tested_rho_and_marks_the_verdict_on_it(few_tokens):
    pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install 'eigenhooks[plot]')")
    from eigenhooks.run import plots

    df = few_tokens[few_tokens["target"] == "ov/modulus"].sort_values("layer")
    fig = plots.alignment_by_layer(few_tokens, "modulus")
    ax = fig.axes[1]
    by_label = {c.get_label(): c.get_offsets() for c in ax.collections if hasattr(c, "get_offsets")}
    ring = by_label["ρ on the null's tokens"]
    assert [tuple(p) for p in ring] == [(x, y) for x, y in zip(df["layer"], df["rho_null_tokens"])]
    toward = df[df["verdict"] == "toward"]
    assert len(toward)
    got = sorted(tuple(p) for p in by_label["toward (q < 0.05)"])
    assert got == sorted(zip(toward["layer"].astype(float), toward["rho_null_tokens"]))
