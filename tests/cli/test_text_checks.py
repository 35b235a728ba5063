"""--text is checked before the model loads, for `run` and `iterate` alike (issue 41): a blank text and bytes
that are no UTF-8 are refused in one line naming the byte and its offset, as --file's are."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eigenhooks.cli import app
from eigenhooks.run import DataLoadError, run

runner = CliRunner()
CUT = "The caf\udcc3 is open"  # b"The caf\xc3 is open" as a command line hands it to Python (surrogateescape)


@pytest.fixture
def no_load(monkeypatch):
    """Any model load fails the test: the text must be refused first."""
    import eigenhooks.zoo.loading as loading

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the text was checked")

    monkeypatch.setattr(loading, "load_model", refuse)


def _one_error(args) -> str:
    r = runner.invoke(app, args)
    lines = r.output.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1 and lines[0].startswith("eigenhooks: error: "), r.output
    return lines[0].removeprefix("eigenhooks: error: ")


@pytest.mark.parametrize("command", ["run", "iterate"])
def test_a_cut_character_is_named_before_the_load(command, no_load, tmp_path):
    out = ["--out", str(tmp_path / "o")] if command == "run" else []
    msg = _one_error([command, "gpt2-tiny", "--text", CUT, *out])
    assert msg.startswith("--text is not UTF-8 text (byte 0xc3 at offset 7)"), msg
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("text", ["", "   ", " \n\t "])
def test_iterate_refuses_a_blank_text_as_run_does(text, no_load, tmp_path):
    assert _one_error(["iterate", "--text", text]) == _one_error(["run", "--text", text, "--out", str(tmp_path / "o")])
    assert _one_error(["iterate", "--text", text]).startswith("--text is blank")


def test_a_lone_surrogate_from_python_is_named():
    with pytest.raises(DataLoadError, match=r"--text holds the lone surrogate U\+D800 at character 3"):
        run("gpt2-tiny", text="abc\ud800", progress=False)


def test_the_bytes_of_a_real_command_line():
    """What a shell passes: bytes in argv, not a str built in Python."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    r = subprocess.run(
        [sys.executable, "-m", "eigenhooks", "iterate", "--text", b"The caf\xc3 is open"],
        capture_output=True,
        env=env,
        timeout=300,
    )
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 1 and "--text is not UTF-8 text (byte 0xc3 at offset 7)" in err, err
