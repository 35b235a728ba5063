"""`eigenhooks --version`, and --help that prints types as people read them (TEXT, INTEGER), not
Python's (`<bool>`, `<str>`, `<list[str]>`, which typer >= 0.24 prints)."""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

import eigenhooks as eh
from eigenhooks.cli import app

runner = CliRunner()


def _paths(group, above=()):
    for name, cmd in sorted(group.commands.items()):
        yield [*above, name]
        if hasattr(cmd, "commands"):
            yield from _paths(cmd, (*above, name))


COMMANDS = list(_paths(typer.main.get_command(app)))


def test_version_says_the_package_and_what_it_runs_on():
    import torch

    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"eigenhooks {eh.__version__} (torch {torch.__version__}, transformers ")
    assert len(r.output.strip().splitlines()) == 1


@pytest.mark.parametrize("command", [[], *COMMANDS], ids=lambda c: " ".join(c) or "eigenhooks")
def test_help_prints_no_python_types(command):
    r = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "160"}, terminal_width=160)
    assert r.exit_code == 0, r.output
    python_types = re.findall(r"<(?:bool|str|int|float|list\[[^\]]*\]|Path)>", r.output)
    assert python_types == [], python_types
    assert "--help" in r.output


def test_help_names_a_values_kind_and_none_for_a_flag():
    out = runner.invoke(app, ["run", "--help"], env={"COLUMNS": "160"}, terminal_width=160).output
    lines = {ln.split()[1]: ln for ln in out.splitlines() if ln.startswith("│ --")}
    assert re.search(r"--max-tokens\s+INTEGER\s", lines["--max-tokens"])
    assert re.search(r"--text\s+TEXT\s", lines["--text"])
    assert re.search(r"--dist-timeout\s+FLOAT\s", lines["--dist-timeout"])
    assert re.search(r"--overwrite\s+replace", lines["--overwrite"])  # a flag: its help right after it
    steer = runner.invoke(app, ["steer", "--help"], env={"COLUMNS": "160"}, terminal_width=160).output
    assert re.search(r"--prompt\s+TEXT\s", steer)
