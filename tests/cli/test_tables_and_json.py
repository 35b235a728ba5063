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
    assert "cos(v1', u) 1.0000" in r.output and "before" in r.output and "p(' return')" in r.output


def test_steer_command_errors_in_one_line():
    r = runner.invoke(app, ["steer", "albert-tiny", "--toward", " return", "--alpha", "1"])
    assert r.exit_code == 1 and "shares its weights" in r.output and "Traceback" not in r.output


def test_run_input_errors_are_one_line(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9 au lait")
    cfg = tmp_path / "broken"
    cfg.mkdir()
    (cfg / "config.json").write_text('{"model_type": "gpt2",')
    cases = [
        (["run", "--batch-size", "-1"], "--batch-size must be a positive integer, got -1"),
        (["run", "--batch-size", "0"], "--batch-size must be a positive integer, got 0"),
        (["run", "--max-tokens", "-5"], "--max-tokens must be a positive integer, got -5"),
        (["run", "--text", "  \n "], "--text is blank"),
        (["run", "--file", str(bad)], f"{bad} is not UTF-8 text (byte 0xe9 at offset 3)"),
        (["spectrum", str(cfg)], "config.json is not valid JSON"),
    ]
    for args, msg in cases:
        r = runner.invoke(app, [*args, *(["--out", str(tmp_path / "o")] if args[0] == "run" else [])])
        assert r.exit_code == 1 and msg in r.output and "hub did not answer" not in r.output, (args, r.output)
        assert len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "o").exists()


def test_verify_json_has_no_bare_nan(monkeypatch):
    import eigenhooks
    from eigenhooks.spectra import Verification

    monkeypatch.setattr(eigenhooks, "verify", lambda m: [Verification(0, float("nan"), 1.0, "float32")])
    r = runner.invoke(app, ["verify", "--json"])
    assert r.exit_code == 0, r.output

    def refuse(c):
        raise ValueError(f"bare {c} in JSON")

    rows = json.loads(r.output[r.output.index("[") :], parse_constant=refuse)
    assert rows[0]["max_abs_diff"] is None
