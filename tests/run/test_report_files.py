"""`eigenhooks report` on folders damaged outside the tables: every file the run wrote, and meta.json itself."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from typer.testing import CliRunner

from eigenhooks.cli import app
from eigenhooks.run import run
from eigenhooks.run.report import inspect

runner = CliRunner()


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """A real gpt2-tiny run (4 layers x 2 targets, 3 forwards)."""
    out = tmp_path_factory.mktemp("runs") / "a"
    res = run("gpt2-tiny", max_tokens=300, batch_size=1, out=out, progress=False)
    assert res.status == "complete" and res.forwards > 1
    return out


@pytest.fixture
def folder(whole, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(whole, out)
    return out


def _edit_meta(folder, **changes) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    meta.update(changes)
    (folder / "meta.json").write_text(json.dumps(meta, indent=2))


def _damage(folder, how: str) -> str:
    """Damage the copy; return a regex one of the listed problems must match."""
    stats = folder / "stats.jsonl"
    meta = json.loads((folder / "meta.json").read_text())
    if how == "stats_deleted":
        stats.unlink()
        return "stats.jsonl is missing"
    if how == "stats_cut":  # one whole line fewer: still valid JSON lines
        lines = stats.read_text().splitlines(keepends=True)
        stats.write_text("".join(lines[:-1]))
        return "stats.jsonl is not the file meta.json recorded"
    if how == "spectra_deleted":
        (folder / "spectra.json").unlink()
        return "spectra.json is missing"
    if how == "plot_deleted":
        (folder / "eigenvalues.png").unlink()
        return "eigenvalues.png is missing"
    if how == "status_word":
        _edit_meta(folder, status="fine")
        return "meta.json's status 'fine' is none of running, complete, interrupted, failed"
    if how == "forwards_changed":
        _edit_meta(folder, forwards=meta["forwards"] + 5)
        return f"stats.jsonl holds {meta['forwards']} forward\\(s\\), meta.json says {meta['forwards'] + 5}"
    if how == "tokens_changed":
        _edit_meta(folder, n_tokens=meta["n_tokens"] - 1)
        return f"summary.csv counts {meta['n_tokens']} tokens, meta.json says {meta['n_tokens'] - 1}"
    if how == "old_meta_stats_deleted":  # a folder from before the files record: the forward count still speaks
        meta.pop("files", None)
        meta.pop("format", None)
        (folder / "meta.json").write_text(json.dumps(meta))
        stats.unlink()
        return f"stats.jsonl is missing \\(meta.json says {meta['forwards']} forwards\\)"
    if how in ("tables_removed", "tables_null", "files_removed"):  # issue 41: then a table edit went unseen
        _edit_summary(folder)
        name = how.split("_")[0]
        if how.endswith("null"):
            _edit_meta(folder, **{name: None})
            return f"meta.json's {name} record is null, not an object"
        meta.pop(name)
        (folder / "meta.json").write_text(json.dumps(meta))
        return f"meta.json has no {name} record \\(a finished run of format 2 writes one\\)"
    if how == "forwards_text":
        _edit_meta(folder, forwards="x")
        return 'meta.json\'s forwards is "x", not an integer'
    if how == "tokens_bool":
        _edit_meta(folder, n_tokens=True)
        return "meta.json's n_tokens is true, not an integer"
    raise ValueError(how)


def _edit_summary(folder) -> None:
    """Change one number in summary.csv (its rows, layers and targets stay)."""
    import pandas as pd

    df = pd.read_csv(folder / "summary.csv")
    df.loc[0, "rho"] = 0.123456
    df.to_csv(folder / "summary.csv", index=False)


def test_a_whole_folder_records_every_file_and_is_not_marked(folder):
    meta = json.loads((folder / "meta.json").read_text())
    assert {"stats.jsonl", "spectra.json", "eigenvalues.png"} <= set(meta["files"])
    assert inspect(folder)[2] == []


HOWS = [
    "stats_deleted",
    "stats_cut",
    "spectra_deleted",
    "plot_deleted",
    "status_word",
    "forwards_changed",
    "tokens_changed",
    "old_meta_stats_deleted",
    "tables_removed",
    "tables_null",
    "files_removed",
    "forwards_text",
    "tokens_bool",
]


@pytest.mark.parametrize("how", HOWS)
def test_a_folder_damaged_outside_its_tables_is_not_complete(folder, how):
    want = _damage(folder, how)
    problems = inspect(folder)[2]
    assert any(re.search(want, p) for p in problems), problems
    r = runner.invoke(app, ["report", str(folder)])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1 and f"{folder} is damaged" in lines[0], r.output
    page = (folder / "report.html").read_text().replace("&#x27;", "'")
    assert "Damaged run folder." in page and ", complete." not in page


def test_a_folder_from_before_the_records_is_told_apart_by_its_format(folder):
    """No ``format``, no ``tables``, no ``files``: written before they existed, checked for what it shows."""
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["format"] == 2
    for name in ("format", "tables", "files"):
        meta.pop(name)
    (folder / "meta.json").write_text(json.dumps(meta))
    assert inspect(folder)[2] == []
    r = runner.invoke(app, ["report", str(folder)])
    assert r.exit_code == 0 and "damaged" not in r.output, r.output
