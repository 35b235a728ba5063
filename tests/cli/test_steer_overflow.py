"""`steer` with a strength that overflows the model's activations fails in one line, not a table of NaN."""

from __future__ import annotations

from typer.testing import CliRunner

from eigenhooks.cli import app

runner = CliRunner()


def test_an_alpha_that_overflows_is_one_line_and_rc_1():
    r = runner.invoke(app, ["steer", "--alpha", "1e30", "--top-k", "2"])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1, r.output
    assert lines[0].startswith("eigenhooks: error: steering with --alpha 1e+30 drove the model's outputs to NaN or inf")
    assert "give a smaller --alpha, or --gap-ratio instead" in lines[0]


def test_a_usual_alpha_still_prints_its_table():
    r = runner.invoke(app, ["steer", "--alpha", "5", "--top-k", "2"])
    assert r.exit_code == 0 and "nan" not in r.output.lower(), r.output
