"""--out given as a symbolic link or as a place no folder can be made: no leftovers, no internal names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eigenhooks.cli import app
from eigenhooks.run import run
from eigenhooks.run.folder import RunFolder, RunFolderError

runner = CliRunner()


def test_overwrite_through_a_link_replaces_the_run_it_points_to(tmp_path):
    real = tmp_path / "real"
    run("gpt2-tiny", max_tokens=64, out=real, progress=False)
    link = tmp_path / "link"
    link.symlink_to(real)
    r = runner.invoke(app, ["run", "--max-tokens", "128", "--out", str(link), "--overwrite"])
    assert r.exit_code == 0, r.output
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert json.loads((link / "meta.json").read_text())["max_tokens"] == 128
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no .link.old-* or .real.old-* left


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs /proc")
def test_an_out_where_no_folder_can_be_made_names_the_flag_not_a_temporary_path():
    with pytest.raises(RunFolderError) as e:
        RunFolder(Path("/proc/eigenhooks-x")).open({})
    msg = str(e.value)
    assert msg.startswith("--out /proc/eigenhooks-x: cannot create a folder in /proc") and ".tmp-" not in msg, msg
