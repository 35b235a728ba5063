"""Every CLI table reads at 80, 100 and 160 columns and piped: no cut number ('…'), no vanished column (one a
narrow terminal leaves out is named in the caption), no line wider than the terminal; piped, every column
whole at its natural width, however long the rows (as ``run`` does). ``spectrum``, ``spectrum --heads``,
``verify``, ``steer`` and ``run --heads``, each as a user runs it: a terminal of the width (rich reads
TTY_COMPATIBLE and COLUMNS as it reads a real one), and a pipe."""

from __future__ import annotations

import functools
import re

import pytest
from rich.cells import cell_len
from thirty_layers import thirty_layer_folder
from typer.testing import CliRunner

from eigenhooks.cli import app

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
WIDTHS = [80, 100, 160, None]  # None: piped


@pytest.fixture(scope="module")
def thirty(tmp_path_factory):
    return thirty_layer_folder(tmp_path_factory.mktemp("m30") / "model")


def _invoke(args, width):
    return _output(tuple(args), width)


@functools.cache  # the piped output each width's check compares with: one run per command, not one per width
def _output(args: tuple, width):
    env = {"TTY_COMPATIBLE": "0", "COLUMNS": ""} if width is None else {"TTY_COMPATIBLE": "1", "COLUMNS": str(width)}
    r = CliRunner().invoke(app, list(args), env=env)
    assert r.exit_code == 0, r.output
    return ANSI.sub("", r.stdout)


def tables(text: str) -> list[dict]:
    """Each rich table of ``text``: its headers (a wrapped header joined), its body lines, its caption."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.startswith("┏"):
            continue
        heads: list[list[str]] = []
        j = i + 1
        while lines[j].startswith("┃"):
            cells = [c.strip() for c in lines[j].strip("┃").split("┃")]
            heads = [cells] if not heads else heads + [cells]
            j += 1
        names = [" ".join(h[k] for h in heads if h[k]) for k in range(len(heads[0]))]
        body = []
        j += 1
        while not lines[j].startswith("└"):
            body.append(lines[j])
            j += 1
        caption = lines[j + 1].strip() if j + 1 < len(lines) else ""
        out.append({"heads": names, "body": body, "caption": caption, "lines": lines[i : j + 1]})
    return out


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip("│").split("│")]


def _check(args, width, columns: list[list[str]]):
    """Run ``args`` at ``width``; its tables have ``columns`` (all of them piped or where they fit)."""
    text = _invoke(args, width)
    found = tables(text)
    assert len(found) == len(columns), text[:2000]
    assert "…" not in text, text  # no cut number, no cut header
    piped = tables(_invoke(args, None)) if width is not None else found
    for t, cols, whole in zip(found, columns, piped):
        if width is not None:
            assert max(cell_len(x) for x in t["lines"]) <= width, (width, max(map(cell_len, t["lines"])))
            gone = [c for c in cols if c not in t["heads"]]
            assert all(c in t["caption"] for c in gone), (gone, t["caption"])  # a column left out is named
        else:
            assert t["heads"] == cols  # piped: every column
            assert len({cell_len(x) for x in t["lines"]}) == 1  # every row whole, none wrapped
        # a token list wraps between tokens, never inside one ("differe" / "nce")
        for k, c in enumerate(t["heads"]):
            if c.startswith("v_1 top tokens") and width is not None:
                theirs = {w for line in whole["body"] for w in _cells(line)[whole["heads"].index(c)].split()}
                ours = {w for line in t["body"] for w in _cells(line)[k].split()}
                assert ours <= theirs, sorted(ours - theirs)[:10]
        # every number of the kept columns, as piped shows it, is in this table whole
        keep = [k for k, c in enumerate(whole["heads"]) if c in t["heads"]]
        body = "\n".join(t["body"])
        for line in whole["body"][:40]:
            for k in keep:
                cell = _cells(line)[k]
                if re.fullmatch(r"[-+≤<]?\d[\d.e+-]*", cell):
                    assert cell in body, (cell, whole["heads"][k])
    return found


SPECTRUM = ["layer", "lambda_1", "|lambda_1|", "kind", "gap ratio", "k"]
PARTS = ["layer", "part", "|lambda_1|", "kind", "k", "copying", "circuit copying", "score", "null 95%", "p", "q"]
PARTS += ["v_1 top tokens (␣ a space)"]


@pytest.mark.parametrize("width", WIDTHS)
def test_spectrum_and_its_heads(thirty, width):
    _check(["spectrum", str(thirty), "--heads"], width, [SPECTRUM, PARTS])


@pytest.mark.parametrize("width", WIDTHS)
def test_verify(width):
    _check(
        ["verify", "gpt2-tiny"], width, [["layer", "check", "max |diff|", "relative", "linearity", "linear", "dtype"]]
    )


@pytest.mark.parametrize("width", WIDTHS)
def test_steer(width):
    found = _check(["steer", "gpt2-tiny", "--top-k", "4"], width, [["next token", "p before", "p after", "change"]])
    assert any("(--toward)" in line for line in found[0]["body"])
    assert found[0]["caption"].startswith("rows: the top 4 before and after")  # why the rows are in that order
    text = _invoke(["steer", "gpt2-tiny", "--top-k", "4"], width)
    assert "prompt: 'def f(x):\\n    y = x + 1\\n   '" in text  # the prompt on its own line, not in the title
    assert "p(' return') at the prompt's last token:" in text


@pytest.fixture(scope="module")
def run_once():
    """The library's ``run``, each distinct study computed once: every width prints the same result (this file
    checks the command's tables, not the run; four runs of the thirty-layer model took 51 s at load ~3)."""
    from eigenhooks.run import job

    real, done = job.run, {}

    def run(model, **kw):
        key = (model, kw["max_tokens"], kw["heads"], tuple(sorted(kw["nulls"].items())))
        if key not in done:
            done[key] = real(model, **kw)
        return done[key]

    return run


@pytest.mark.parametrize("width", WIDTHS)
def test_run_with_heads(thirty, width, tmp_path, run_once, monkeypatch):
    monkeypatch.setattr("eigenhooks.run.job.run", run_once)
    args = ["run", str(thirty), "--heads", "--max-tokens", "200", "--null-draws", "16", "--fnull-draws", "8"]
    text = _invoke(args + ["--out", str(tmp_path / "r")], width)
    found = tables(text)
    assert "…" not in text and len(found) == 2, text[:3000]
    for t in found:
        if width is not None:
            assert max(cell_len(x) for x in t["lines"]) <= width
        else:
            assert len({cell_len(x) for x in t["lines"]}) == 1
    assert found[1]["heads"][:2] == ["layer", "target"] and len(found[1]["body"]) >= 30


@pytest.mark.real
@pytest.mark.parametrize("width", WIDTHS)
def test_smollm2_spectrum_heads_with_its_real_tokens(width):
    """SmolLM2's 270 heads and 90 groups with their real top tokens (the table the issue could not read)."""
    found = _check(["spectrum", "smollm2-135m", "--heads"], width, [SPECTRUM, PARTS])
    assert len([x for x in found[1]["body"] if x.split("│")[1].strip()]) == 360


def test_the_telling_rows_measure_as_every_row_does():
    """``fit_table`` measures a table by the rows holding each column's longest line and longest word (360 head
    rows took 3 s a width to measure): on random rows, wrapped or not, these measure as all the rows do."""
    import io
    import random

    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from eigenhooks.run.table import _telling_rows

    rng = random.Random(0)
    measure = Console(width=10_000, file=io.StringIO())

    def cell() -> str:
        text = " ".join("x" * rng.randint(1, 12) for _ in range(rng.randint(0, 6)))
        return text + ("\n" + "y" * rng.randint(1, 40) if rng.random() < 0.1 else "")  # a second line, sometimes

    def table(rows, n, no_wrap):
        t = Table(collapse_padding=True)
        for i in range(n):
            t.add_column(f"c{i}", no_wrap=no_wrap, overflow="fold")
        for r in rows:
            t.add_row(*[Text(x) for x in r])
        return t

    for _ in range(30):
        n = rng.randint(1, 6)
        cells = [[cell() for _ in range(n)] for _ in range(rng.randint(1, 60))]
        telling = _telling_rows(cells, n)
        assert len(telling) <= 2 * n
        for no_wrap in (True, False):
            assert measure.measure(table(telling, n, no_wrap)) == measure.measure(table(cells, n, no_wrap))
