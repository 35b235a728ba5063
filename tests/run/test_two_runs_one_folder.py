"""Two runs into one folder: a finished run is never replaced without --overwrite (issue 29, item 2).

Real processes race for the final rename (both paused before it, then let go together), and the
same races are replayed in-process, in each order, on ``RunFolder`` itself.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from eigenhooks.run import RunFolderError, run
from eigenhooks.run.folder import RunFolder

PAUSED = "eigenhooks-test: paused at"
ROOT = Path(__file__).resolve().parents[2]


def _meta(p: Path) -> dict:
    return json.loads((p / "meta.json").read_text())


def _start(cwd: Path, go: Path, *args: str) -> subprocess.Popen:
    """`eigenhooks run` that pauses before its final files until ``go`` exists."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "EIGENHOOKS_TEST_PAUSE": "finish",
        "EIGENHOOKS_TEST_PAUSE_S": "120",
        "EIGENHOOKS_TEST_RESUME": str(go),
    }
    cmd = [sys.executable, "-m", "eigenhooks", "run", "--max-tokens", "128", *args]
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _race(cwd: Path, *args: str) -> list[tuple[subprocess.Popen, str, list[str]]]:
    """Two runs, both held just before writing their folder, then let go at once: (process, stdout, stderr lines)."""
    go = cwd / "go"
    procs = [_start(cwd, go, *args) for _ in range(2)]
    for p in procs:
        for line in p.stderr:
            if line.startswith(PAUSED):
                break
        else:
            raise AssertionError(f"never paused; rc={p.wait()}")
    go.touch()
    res = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)
        res.append((p, stdout, [x for x in stderr.splitlines() if x.strip()]))
    return res


def test_two_processes_with_one_out_never_destroy_a_finished_run(tmp_path):
    out = tmp_path / "run"
    res = _race(tmp_path, "--out", str(out))
    won = [r for r in res if r[0].returncode == 0]
    lost = [r for r in res if r[0].returncode != 0]
    assert len(won) == 1 and len(lost) == 1, [(p.returncode, err) for p, _, err in res]
    (winner, w_out, _), (loser, l_out, l_err) = won[0], lost[0]
    assert loser.returncode == 1 and f"run folder: {out}" in w_out and "run folder:" not in l_out
    meta = _meta(out)
    assert meta["pid"] == winner.pid and meta["status"] == "complete" and meta["out"] == str(out)
    aside = tmp_path / "run-2"
    assert len(l_err) == 1 and str(out) in l_err[0] and str(aside) in l_err[0], l_err
    assert f"pid {winner.pid}" in l_err[0]  # where the other run is, and whose it is
    kept = _meta(aside)
    assert kept["pid"] == loser.pid and kept["status"] == "complete" and kept["out"] == str(aside)
    assert (aside / "summary.csv").exists() and (aside / "stats.jsonl").exists()
    assert not list(tmp_path.glob(".run.*"))


def test_two_processes_with_the_default_out_get_two_folders(tmp_path):
    res = _race(tmp_path)
    assert [p.returncode for p, _, _ in res] == [0, 0], [err for _, _, err in res]
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2
    for p, stdout, _ in res:
        (mine,) = [r for r in runs if _meta(r)["pid"] == p.pid]
        assert f"run folder: runs/{mine.name} " in stdout
        assert re.fullmatch(r"gpt2-tiny-\d{8}-\d{6}-[0-9a-f]{4}", mine.name), mine.name


def test_default_names_differ_within_one_second(tmp_path, monkeypatch):
    from eigenhooks.run import job

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(job.time, "strftime", lambda *a: "20260101-000000")  # both start in one second
    a = run("gpt2-tiny", max_tokens=64, progress=False)
    b = run("gpt2-tiny", max_tokens=64, progress=False)
    assert a.out != b.out and _meta(a.out)["status"] == _meta(b.out)["status"] == "complete"
    assert a.out.parent == b.out.parent == Path("runs")


def _open(out: Path, **kw) -> RunFolder:
    f = RunFolder(out, **kw)
    f.open({"who": str(id(f))})
    return f


def _finish(f: RunFolder) -> None:
    f.finish("complete", None, None, measured=True)


def test_the_second_to_finish_into_a_named_out_is_kept_aside_and_fails(tmp_path):
    out = tmp_path / "run"
    a, b, c = _open(out), _open(out), _open(out)  # all three start while out is free
    assert len({a.path, b.path, c.path}) == 3  # one process, three runs: three temporary folders
    _finish(a)
    with pytest.raises(RunFolderError, match=r"--out .*run was taken by another run .*this run .* is in .*run-2"):
        _finish(b)
    assert _meta(out)["who"] == a.meta["who"]
    kept = _meta(tmp_path / "run-2")
    assert kept["who"] == b.meta["who"] and kept["out"] == str(tmp_path / "run-2")
    (tmp_path / "run-3").mkdir()
    (tmp_path / "run-3" / "notes.txt").write_text("mine")  # not a run, not empty: skipped, untouched
    with pytest.raises(RunFolderError, match="run-4"):
        _finish(c)
    assert (tmp_path / "run-3" / "notes.txt").read_text() == "mine"
    assert not list(tmp_path.glob(".run.*"))


def test_overwrite_replaces_only_the_run_that_was_there(tmp_path):
    out = tmp_path / "run"
    _finish(_open(out))
    a, b = _open(out, overwrite=True), _open(out, overwrite=True)
    _finish(a)  # replaces the old run: what --overwrite asked for
    assert _meta(out)["who"] == a.meta["who"]
    with pytest.raises(RunFolderError, match="taken by another run"):
        _finish(b)  # a's run finished after b started: b was not asked to replace it
    assert _meta(out)["who"] == a.meta["who"] and _meta(tmp_path / "run-2")["who"] == b.meta["who"]


def test_an_unnamed_out_taken_meanwhile_moves_on_and_says_so(tmp_path):
    out = tmp_path / "runs" / "gpt2-tiny-x"
    a, b = _open(out, named=False), _open(out, named=False)
    _finish(a)
    from eigenhooks.run.folder import RunFolderWarning

    with pytest.warns(
        RunFolderWarning, match=r"gpt2-tiny-x was taken by another run .* this run .*is in .*gpt2-tiny-x-2"
    ):
        _finish(b)
    assert b.out == out.with_name("gpt2-tiny-x-2") and _meta(b.out)["who"] == b.meta["who"]
    assert _meta(out)["who"] == a.meta["who"]


def test_an_empty_folder_made_meanwhile_is_filled(tmp_path):
    out = tmp_path / "run"
    a = _open(out)
    out.mkdir()  # e.g. the user prepared it: holds nothing, so nothing is lost
    _finish(a)
    assert _meta(out)["who"] == a.meta["who"]
