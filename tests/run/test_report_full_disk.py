"""A disk that fills while report.html is written: no cut-off report, meta.json and the exit code say so."""

from __future__ import annotations

import errno
import json
import pathlib

from typer.testing import CliRunner

from eigenhooks.cli import app

runner = CliRunner()


def test_a_full_disk_while_writing_the_report(tmp_path, monkeypatch):
    real_write = pathlib.Path.write_text

    def full(self, data, *a, **k):
        if "report.html" in self.name:
            real_write(self, data[: len(data) // 3], *a, **k)  # part of the page, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real_write(self, data, *a, **k)

    monkeypatch.setattr(pathlib.Path, "write_text", full)
    out = tmp_path / "run"
    r = runner.invoke(app, ["run", "--max-tokens", "128", "--out", str(out)])
    assert r.exit_code == 1, r.output
    said = [x for x in r.output.splitlines() if x.startswith("eigenhooks: ")]
    assert said == [
        "eigenhooks: warning: report.html not written (No space left on device); the run's files are whole: "
        f"free space, then `eigenhooks report {out}`"
    ], r.output
    assert not list(out.glob("*report.html*")), list(out.iterdir())  # no cut-off page left behind
    meta = json.loads((out / "meta.json").read_text())
    assert meta["status"] == "complete" and meta["report"] == "not written: No space left on device"
    monkeypatch.setattr(pathlib.Path, "write_text", real_write)
    r = runner.invoke(app, ["report", str(out)])  # space again: the report is rebuilt, the folder is whole
    assert r.exit_code == 0 and (out / "report.html").read_text().rstrip().endswith("</html>"), r.output
