"""`--overwrite` killed between its two renames: neither complete run is ever deleted as stale."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest

from eigenhooks.run import folder as F
from eigenhooks.run import run
from eigenhooks.run.folder import RunFolderError, RunFolderWarning


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _killed_between_renames(out, monkeypatch) -> tuple[dict, dict]:
    """A complete run in ``out``, then an --overwrite whose process 'dies' after the first rename.

    The death is simulated in-process: the second rename raises, and the two hidden folders are
    then given the pid of a process that is gone, as a SIGKILL there would leave them.
    Returns the meta.json of the old and of the new run.
    """
    run("gpt2-tiny", max_tokens=128, out=out, progress=False)
    old_meta = json.loads((out / "meta.json").read_text())
    real_rename = os.rename

    def killed(src, dst):
        if ".tmp-" in os.fspath(src) and os.fspath(dst) == os.fspath(out):
            raise SystemExit("killed between the renames")
        return real_rename(src, dst)

    monkeypatch.setattr(F.os, "rename", killed)
    with pytest.raises(SystemExit):
        run("gpt2-tiny", max_tokens=256, out=out, overwrite=True, progress=False)
    monkeypatch.setattr(F.os, "rename", real_rename)
    assert not out.exists()
    dead = _dead_pid()
    hidden = sorted(out.parent.glob(f".{out.name}.*"))
    assert {p.name.split("-")[0] for p in hidden} == {f".{out.name}.tmp", f".{out.name}.old"}, hidden
    new_meta = None
    for p in hidden:
        tag = p.name.rsplit("-", 1)[0]
        moved = p.with_name(f"{tag}-{dead}")
        p.rename(moved)
        if ".tmp-" in p.name:
            new_meta = json.loads((moved / "meta.json").read_text())
    return old_meta, new_meta


def test_the_next_run_restores_the_new_run_and_drops_the_replaced_one(tmp_path, monkeypatch):
    out = tmp_path / "run"
    old_meta, new_meta = _killed_between_renames(out, monkeypatch)
    assert new_meta["status"] == "complete"
    with pytest.warns(RunFolderWarning, match=r"finished run \(status complete\) .* was restored to .*run"):
        with pytest.raises(RunFolderError, match="already holds a run"):
            run("gpt2-tiny", max_tokens=64, out=out, progress=False)
    assert json.loads((out / "meta.json").read_text())["run_id"] == new_meta["run_id"]
    assert not list(tmp_path.glob(".run.*"))  # the old run went, as the --overwrite asked
    assert new_meta["replaces"] == old_meta["run_id"]


def test_finished_runs_that_cannot_be_restored_are_kept_and_named(tmp_path, monkeypatch):
    out = tmp_path / "run"
    old_meta, new_meta = _killed_between_renames(out, monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RunFolderWarning)  # another out: its leftovers are not touched
        run("gpt2-tiny", max_tokens=64, out=tmp_path / "other", progress=False)
    shutil.copytree(tmp_path / "other", out)  # meanwhile `out` holds a third run, that replaces neither
    with pytest.warns(RunFolderWarning) as said:
        with pytest.raises(RunFolderError, match="already holds a run"):
            run("gpt2-tiny", max_tokens=64, out=out, progress=False)
    texts = [str(w.message) for w in said if w.category is RunFolderWarning]
    assert len(texts) == 2 and all("is kept at" in t and "is taken" in t for t in texts), texts
    kept = sorted(tmp_path.glob(".run.*"))
    run_ids = {json.loads((p / "meta.json").read_text())["run_id"] for p in kept}
    assert run_ids == {old_meta["run_id"], new_meta["run_id"]}  # both runs still exist
