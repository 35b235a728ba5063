"""The run table reads on the terminal it is printed on: no number cut to '0…' at 80, 100 or 120 columns.

Below 160 columns it drops whole columns (DROP_ORDER) until the rest fits, and its caption names them
and where they are (--wide, summary.csv); at 160 and more, and when piped, it shows every column. The
summary is the monitor's own on gpt2-tiny, with the kinds, eigenvalue moduli and percentiles a 30-layer
model prints (SmolLM2: |λ1| up to 117, pct 7.8e-03) put in, so the widest cells are the real ones.
"""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console

import eigenhooks as eh
from eigenhooks.run.table import DROP_ORDER, RUN_COLUMNS, print_run_table, rows, run_table

TEXTS = ["def add(a, b):\n    return a + b", "A class statement defines a class object."] * 2
TITLE = "smollm2-135m: alignment per layer (3057 tokens)"


@pytest.fixture(scope="module")
def summary():
    model, tok = eh.zoo.load("gpt2-tiny")
    with eh.monitor(model) as mon, torch.no_grad():
        model(**tok(TEXTS, return_tensors="pt", padding=True))
    df = mon.summary()
    df.loc[0, "kind"] = "complex-dominant"
    df.loc[1, "kind"] = "near-degenerate"
    df.loc[2, "abs_lambda_1"] = 117.204
    df.loc[3, "rho_percentile"] = 0.0078
    return df


def _render(table, width: int) -> str:
    console = Console(width=width, file=io.StringIO(), record=True)
    console.print(table)
    return console.export_text()


@pytest.mark.parametrize("width", [80, 100, 120, 200])
def test_no_cell_is_cut_at_any_width(summary, width):
    table, dropped = run_table(TITLE, summary, width)
    text = _render(table, width)
    lines = text.splitlines()
    assert max(len(x) for x in lines) <= width
    assert "…" not in text, text
    heads, cells = rows(summary)
    kept = [i for i, h in enumerate(heads) if h not in dropped]
    body = [x for x in lines if x.startswith("│")]
    assert len(body) == len(cells)
    for line, row in zip(body, cells):  # every kept cell whole, in its row
        parts = [p.strip() for p in line.strip("│").split("│")]
        assert parts == [row[i] for i in kept], (parts, row)
    for h in (h for i, h in enumerate(heads) if i in kept):
        assert h in text  # whole headers too
    assert dropped == list(DROP_ORDER[: len(dropped)])  # whole columns, in their order
    for must in ("layer", "target", "Δγ [95% CI]", "verdict"):  # the tested number and what it decided
        assert must not in dropped
    if width >= 160:
        assert dropped == [] and "--wide" not in text
    else:
        assert dropped and "--wide, or summary.csv" in " ".join(text.split())
        assert all(h in " ".join(text.split()) for h in dropped)  # the caption names what went
    if width >= 100:  # what decides a claim reads at 100 columns
        assert {"null Δγ 95%", "q"}.isdisjoint(dropped)


def test_kind_reads_as_the_api_spells_it(summary):
    heads, cells = rows(summary)
    col = heads.index("kind")
    assert [r[col] for r in cells] == summary["kind"].tolist()
    assert {r[col] for r in cells} >= {"complex-dominant", "near-degenerate"}
    assert all(r[col] in ("real-dominant", "complex-dominant", "near-degenerate") for r in cells)


def test_piped_and_wide_print_every_column_whole(summary):
    heads = [h for h, _ in RUN_COLUMNS]
    piped = io.StringIO()
    print_run_table(TITLE, summary, console=Console(width=80, file=piped))  # not a terminal: piped
    narrow = io.StringIO()
    print_run_table(TITLE, summary, wide=True, console=Console(width=80, file=narrow, force_terminal=True))
    for out in (piped.getvalue(), narrow.getvalue()):
        assert "…" not in out and "--wide" not in out
        assert all(h in out for h in heads)
    compact = io.StringIO()
    print_run_table(TITLE, summary, console=Console(width=100, file=compact, force_terminal=True))
    assert "…" not in compact.getvalue() and "--wide" in compact.getvalue()
