"""User text that looks like Rich markup is printed as it is: no MarkupError, nothing swallowed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

import eigenhooks
from eigenhooks.cli import app

runner = CliRunner()
ZOO = Path(eigenhooks.__file__).parent / "zoo" / "gpt2-tiny"


def _flat(text: str) -> str:
    """The output without whitespace: a long title wraps, and a wrapped line is padded to be centred."""
    return "".join(text.split())


@pytest.fixture
def marked(tmp_path):
    """gpt2-tiny saved in a folder whose name holds markup."""
    out = tmp_path / "m[/]x[bold red]y"
    shutil.copytree(ZOO, out)
    return out


@pytest.mark.parametrize("command", ["spectrum", "verify"])
def test_a_model_folder_with_markup_is_printed_literally(marked, command):
    r = runner.invoke(app, [command, str(marked)])
    assert r.exit_code == 0, r.output
    assert "m[/]x[boldred]y" in _flat(r.output)


def test_run_into_a_folder_with_markup(marked, tmp_path):
    out = tmp_path / "out[/]"
    r = runner.invoke(app, ["run", str(marked), "--max-tokens", "64", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "m[/]x[boldred]y" in _flat(r.output) and (out / "summary.csv").exists()


def test_a_prompt_with_markup_is_printed_literally():
    r = runner.invoke(app, ["steer", "--prompt", "a [/] b [bold red] c", "--top-k", "2"])
    assert r.exit_code == 0, r.output
    assert "a[/]b[boldred]c" in _flat(r.output)
