"""Run folders under real signals: Ctrl-C at every stage, a second Ctrl-C, SIGKILL, reruns."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from eigenhooks.cli import app
from eigenhooks.run import run

runner = CliRunner()
PAUSED = "eigenhooks-test: paused at"


def _meta(p: Path) -> dict:
    return json.loads((p / "meta.json").read_text())


def _start(out: Path, pause: str, *extra: str, seconds: float = 60) -> subprocess.Popen:
    """`eigenhooks run` in a subprocess that pauses at a stage (EIGENHOOKS_TEST_PAUSE) and says so on stderr."""
    env = {**os.environ, "EIGENHOOKS_TEST_PAUSE": pause, "EIGENHOOKS_TEST_PAUSE_S": str(seconds)}
    cmd = [sys.executable, "-m", "eigenhooks", "run", "--max-tokens", "512", "--batch-size", "1", "--out", str(out)]
    return subprocess.Popen(
        [*cmd, *extra], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, preexec_fn=_as_foreground
    )


def _as_foreground() -> None:
    """In the child: SIGINT at its default, as for a job in the foreground of a terminal.

    A shell without job control starts background commands with SIGINT ignored, and the
    child inherits that; Python then installs no KeyboardInterrupt handler, so these tests
    would fail (exit 0 after the pause) when pytest itself runs in such a background job.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_paused(p: subprocess.Popen, lines: list[str]) -> str:
    for line in p.stderr:
        lines.append(line)
        if line.startswith(PAUSED):
            return line.split(PAUSED)[1].strip()
    raise AssertionError(f"never paused; rc={p.wait()}, stderr:\n{''.join(lines)}")


def _finish(p: subprocess.Popen, lines: list[str]) -> list[str]:
    """Wait for the process; its stderr lines that are not the test hook's."""
    lines += p.stderr.read().splitlines(keepends=True)
    p.wait(timeout=120)
    return [x.rstrip("\n") for x in lines if x.strip() and not x.startswith(PAUSED)]


def _report(out: Path):
    return runner.invoke(app, ["report", str(out)])


@pytest.mark.parametrize("stage", ["spectra", "forwards:after-first", "plots"])
def test_ctrl_c_at_a_stage_prints_one_line_and_leaves_a_true_folder(tmp_path, stage):
    out = tmp_path / "run"
    p, lines = _start(out, stage), []
    assert _wait_paused(p, lines) == stage
    p.send_signal(signal.SIGINT)
    err = _finish(p, lines)
    assert p.returncode == 130
    assert len(err) == 1 and err[0].startswith("eigenhooks: interrupted at stage " + stage), err
    assert "Traceback" not in "".join(lines)
    meta = _meta(out)
    assert meta["status"] == "interrupted" and meta["stage"] == stage
    assert not list(tmp_path.glob(".run.tmp-*"))  # renamed into place
    r = _report(out)
    if stage == "spectra":  # nothing measured: report says why, in one line
        assert meta["forwards"] == 0 and not (out / "summary.csv").exists()
        assert r.exit_code == 1 and "holds no statistics" in r.output and len(r.output.strip().splitlines()) == 1
    else:
        assert r.exit_code == 0, r.output
        df = pd.read_csv(out / "summary.csv")
        lines_jsonl = (out / "stats.jsonl").read_text().splitlines()
        assert meta["forwards"] >= 1 and len(lines_jsonl) == meta["forwards"]
        assert (df["n_tokens"] == 128 * meta["forwards"]).all()
        assert "interrupted at stage" in (out / "report.html").read_text()


def test_second_ctrl_c_while_saving_waits_for_the_folder(tmp_path):
    out = tmp_path / "run"
    p, lines = _start(out, "forwards:after-first,finish", seconds=4), []
    assert _wait_paused(p, lines) == "forwards:after-first"
    p.send_signal(signal.SIGINT)
    assert _wait_paused(p, lines) == "finish"
    p.send_signal(signal.SIGINT)  # the second Ctrl-C, while the folder is being written
    err = _finish(p, lines)
    assert p.returncode == 130 and len(err) == 1 and err[0].startswith("eigenhooks: interrupted"), err
    meta = _meta(out)
    assert meta["status"] == "interrupted" and meta["forwards"] == 1
    assert (out / "summary.csv").exists() and (out / "report.html").exists()


def test_ctrl_c_while_saving_a_complete_run_keeps_it_complete(tmp_path):
    out = tmp_path / "run"
    p, lines = _start(out, "finish", "--max-tokens", "256", seconds=4), []
    assert _wait_paused(p, lines) == "finish"
    p.send_signal(signal.SIGINT)
    err = _finish(p, lines)
    assert p.returncode == 0, err
    assert _meta(out)["status"] == "complete" and (out / "report.html").exists()


def test_sigkill_during_overwrite_leaves_the_old_run_whole(tmp_path):
    out = tmp_path / "run"
    first = run("gpt2-tiny", max_tokens=256, out=out, progress=False)
    assert first.status == "complete"
    before = {f: (out / f).read_bytes() for f in ("summary.csv", "stats.jsonl", "meta.json")}
    p, lines = _start(out, "forwards:after-first", "--overwrite"), []
    _wait_paused(p, lines)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    assert {f: (out / f).read_bytes() for f in before} == before  # the old run, untouched
    (stale,) = tmp_path.glob(".run.tmp-*")
    assert _meta(stale)["status"] == "running" and _meta(stale)["stage"] == "forwards:after-first"
    r = _report(stale)
    assert r.exit_code == 1 and "still being written" in r.output and len(r.output.strip().splitlines()) == 1
    again = run("gpt2-tiny", max_tokens=128, out=out, overwrite=True, progress=False)
    assert again.status == "complete" and _meta(out)["max_tokens"] == 128
    assert not list(tmp_path.glob(".run.*"))  # the killed run's leftovers are cleaned up


def test_a_folder_holding_a_run_is_refused_and_overwrite_replaces_it(tmp_path):
    out = tmp_path / "run"
    args = ["run", "--max-tokens", "256", "--out", str(out)]
    assert runner.invoke(app, args).exit_code == 0
    old = (out / "stats.jsonl").read_text()
    r = runner.invoke(app, args)
    assert r.exit_code == 1 and "already holds a run (status complete)" in r.output and "--overwrite" in r.output
    assert (out / "stats.jsonl").read_text() == old
    r = runner.invoke(app, [*args[:2], "128", *args[3:], "--overwrite"])
    assert r.exit_code == 0, r.output
    meta = _meta(out)
    assert meta["max_tokens"] == 128 and meta["n_tokens"] == 128
    assert len((out / "stats.jsonl").read_text().splitlines()) == meta["forwards"] == 1


def test_folders_that_are_not_runs_are_refused(tmp_path):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "thesis.tex").write_text("precious")
    r = runner.invoke(app, ["run", "--max-tokens", "64", "--out", str(busy), "--overwrite"])
    assert r.exit_code == 1 and "holds no eigenhooks run" in r.output
    assert (busy / "thesis.tex").read_text() == "precious"
    f = tmp_path / "file"
    f.write_text("x")
    r = runner.invoke(app, ["run", "--max-tokens", "64", "--out", str(f)])
    assert r.exit_code == 1 and "is a file, not a folder" in r.output


def test_a_failed_run_says_so(tmp_path, monkeypatch):
    from eigenhooks.run import job as R

    def broken(*a, **k):
        raise RuntimeError("plotting broke")

    monkeypatch.setattr(R, "_plots", broken)
    with pytest.raises(RuntimeError, match="plotting broke"):
        run("gpt2-tiny", max_tokens=128, out=tmp_path / "f", progress=False)
    meta = _meta(tmp_path / "f")
    assert meta["status"] == "failed" and meta["stage"] == "plots" and "plotting broke" in meta["error"]
    r = _report(tmp_path / "f")
    assert r.exit_code == 0 and "failed at stage plots" in (tmp_path / "f" / "report.html").read_text()


def test_a_run_that_fails_before_measuring_leaves_nothing(tmp_path):
    r = runner.invoke(app, ["run", str(tmp_path / "no-model"), "--out", str(tmp_path / "x")])
    assert r.exit_code == 1 and "no model folder" in r.output
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.*"))


def test_report_on_damaged_or_missing_folders_is_one_line(tmp_path):
    r = _report(tmp_path / "nowhere")
    assert r.exit_code == 1 and "no run folder at" in r.output
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "summary.csv").write_text("layer\n0\n")
    (bad / "meta.json").write_text("{not json")
    r = _report(bad)
    assert r.exit_code == 1 and "is not valid JSON" in r.output and len(r.output.strip().splitlines()) == 1


def test_old_folders_without_status_still_report(tmp_path):
    out = tmp_path / "old"
    run("gpt2-tiny", max_tokens=128, out=out, progress=False)
    meta = _meta(out)
    del meta["status"]
    (out / "meta.json").write_text(json.dumps(meta))
    assert _report(out).exit_code == 0
