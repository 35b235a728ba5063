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
        (folder / "meta.json").write_text(json.dumps(meta))
        stats.unlink()
        return f"stats.jsonl is missing \\(meta.json says {meta['forwards']} forwards\\)"
    raise ValueError(how)


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
