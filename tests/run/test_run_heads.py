"""``eigenhooks run --heads``: the head targets' rows in summary.csv (equal to a monitor built by hand), a
compact per-head table on the terminal, the per-head verdicts in the report, the layer rows untouched."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

import eigenhooks as eh
from eigenhooks.cli import app
from eigenhooks.run import load_texts, make_batches
from eigenhooks.run.report import inspect

runner = CliRunner()
ARGS = ["run", "--max-tokens", "400", "--batch-size", "2", "--null-stride", "1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same run with and without --heads: (folder with, folder without, the CLI's output with)."""
    base = tmp_path_factory.mktemp("heads")
    r = runner.invoke(app, [*ARGS, "--heads", "--out", str(base / "heads")], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    plain = runner.invoke(app, [*ARGS, "--out", str(base / "plain")])
    assert plain.exit_code == 0, plain.output
    return base / "heads", base / "plain", r.output


def test_summary_has_a_row_per_layer_and_head(runs):
    heads_dir, plain_dir, _ = runs
    df = pd.read_csv(heads_dir / "summary.csv")
    head = df[df["head"].notna()]
    assert len(head) == 4 * 4 and len(df) == 4 * 2 + 16  # gpt2-tiny: 4 layers, 4 heads; 2 layer targets
    assert sorted(zip(head["layer"], head["head"].astype(int))) == [(la, h) for la in range(4) for h in range(4)]
    assert (head["target"] == [f"ov_head/modulus/h{int(h)}" for h in head["head"]]).all()
    # the head rows are what a monitor built by hand measures on the same batches
    model, tok = eh.zoo.load("gpt2-tiny")
    with eh.monitor(
        model, targets=[("ov", "modulus"), ("ov", "residual"), ("ov_head", "modulus")], null_stride=1
    ) as mon:
        with torch.no_grad():
            for ids in make_batches(tok, load_texts(), 400, 128, 2):
                model(input_ids=ids, attention_mask=torch.ones_like(ids))
    direct = mon.summary()
    assert df["target"].tolist() == direct["target"].tolist()
    for col in ("n_tokens", "rho", "null_rho_lo", "null_rho_hi", "p_null", "q_null", "eig_rank"):
        assert ((df[col] - direct[col]).abs() < 1e-9).all() or df[col].equals(direct[col]), col
    # the layer rows are those of the run without --heads
    plain = pd.read_csv(plain_dir / "summary.csv")
    layer = df[df["head"].isna()].drop(columns="head").reset_index(drop=True)
    # Δγ's columns (the verdict's p among them) are float32 sums whose order changes when the head targets'
    # projections are stacked beside the layer targets': equal to rounding; every other column exactly
    floaty = [c for c in plain.columns if c in ("p_null", "q_null") or "dgamma" in c or c.startswith("detectable")]
    pd.testing.assert_frame_equal(layer.drop(columns=floaty), plain.drop(columns=floaty), check_dtype=False)
    pd.testing.assert_frame_equal(layer[floaty], plain[floaty], check_dtype=False, rtol=1e-4)
    assert (layer["verdict"] == plain["verdict"]).all()
    assert inspect(heads_dir)[2] == []  # the folder checks out (grid of layers x targets, meta.json's record)


def test_terminal_shows_heads_compactly(runs):
    heads_dir, _, out = runs
    out = out.split("what stood out:")[0]  # the tables; the findings below them name the rows that stood out
    df = pd.read_csv(heads_dir / "summary.csv")
    assert "alignment per head" in out and "16 head rows" in out and "summary.csv" in out
    lines = [ln for ln in out.splitlines() if "ov_head/modulus" in ln]
    assert len(lines) == 4  # one line per layer, not one per head
    for la, line in enumerate(lines):
        rho = df[(df["layer"] == la) & df["head"].notna()].sort_values("head")["rho"]
        assert all(f"{r:.2f}" in line for r in rho)
    assert "ov_head/modulus/h" not in out  # no head row in the per-layer table


def test_report_shows_per_head_verdicts(runs):
    heads_dir, plain_dir, _ = runs
    page = (heads_dir / "report.html").read_text()
    assert "Per-head verdicts" in page and page.count("ov_head/modulus") >= 4
    # the per-layer table (after the first screen's findings, which name the rows that stood out): layers only
    assert (
        "ov_head/modulus/h"
        not in page.split("What the direction is")[0].split('<section id="stood-out">')[-1].split("</section>", 1)[-1]
    )
    assert "Per-head verdicts" not in (plain_dir / "report.html").read_text()
    meta = json.loads((heads_dir / "meta.json").read_text())
    assert meta["status"] == "complete"
