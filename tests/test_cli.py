"""The CLI: tables, JSON, and one-line errors."""

import json

from typer.testing import CliRunner

from eigenhooks.cli import app

runner = CliRunner()


def test_spectrum_default_model_table():
    r = runner.invoke(app, ["spectrum"])
    assert r.exit_code == 0, r.output
    assert "lambda_1" in r.output and "gap ratio" in r.output


def test_spectrum_json_and_options():
    r = runner.invoke(app, ["spectrum", "albert-tiny", "--json", "--heads", "--rank", "residual", "--variant", "ov_ln"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output[r.output.index("[") :])
    assert len(rows) == 4 and {"lambda_1", "abs_lambda_1", "kind", "gap_ratio", "k", "heads"} <= set(rows[0])
    assert rows[0]["rank"] == "residual" and rows[0]["variant"] == "ov_ln"
    assert rows[0]["lambda_1"] == rows[3]["lambda_1"]  # one shared layer


def test_unknown_model_is_one_line_error(tmp_path):
    r = runner.invoke(app, ["spectrum", str(tmp_path / "nowhere")])
    assert r.exit_code == 1
    assert "error:" in r.output and "Traceback" not in r.output


def test_bad_rank_is_one_line_error():
    r = runner.invoke(app, ["spectrum", "--rank", "biggest"])
    assert r.exit_code == 1 and "rank must be one of" in r.output


def test_verify_command():
    r = runner.invoke(app, ["verify", "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output[r.output.index("[") :])
    assert len(rows) == 4 and all(row["rel_diff"] < 1e-5 for row in rows)


def test_steer_command():
    r = runner.invoke(app, ["steer", "--toward", " return", "--gap-ratio", "0.1", "--top-k", "3"])
    assert r.exit_code == 0, r.output
    assert "cos(v1', u) 0.99" in r.output and "before" in r.output and "p(' return')" in r.output


def test_steer_command_errors_in_one_line():
    r = runner.invoke(app, ["steer", "albert-tiny", "--toward", " return", "--alpha", "1"])
    assert r.exit_code == 1 and "shares its weights" in r.output and "Traceback" not in r.output
