"""A run that fails on a full disk leaves no hidden ``.NAME.tmp-*`` folder, and its error names the path (issue 41).

Once on a real 200 KB tmpfs (root only: mount), once with ENOSPC raised where spectra.json is written
(anywhere), so the test runs without root too.
"""

from __future__ import annotations

import errno
import os
import subprocess

import pytest

from eigenhooks.run import RunFolderError, folder, run


def _run_into(out):
    with pytest.raises(RunFolderError) as e:
        run("gpt2-tiny", max_tokens=200, batch_size=8, out=out, progress=False)
    msg = str(e.value)
    assert f"--out {out}: the run could not be written: No space left on device" in msg, msg
    assert f"its unfinished folder {out.parent}/.{out.name}.tmp-" in msg and "was removed" in msg, msg
    assert sorted(os.listdir(out.parent)) == [], os.listdir(out.parent)


def test_a_full_disk_simulated_where_spectra_json_is_written(tmp_path, monkeypatch):
    real = folder._write_json

    def full(path, obj, indent=2):
        if path.name == "spectra.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, obj, indent)

    monkeypatch.setattr(folder, "_write_json", full)
    (tmp_path / "runs").mkdir()
    _run_into(tmp_path / "runs" / "r")


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_real_200k_tmpfs(tmp_path):
    fs = tmp_path / "fs"
    fs.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(fs)], capture_output=True).returncode:
        pytest.skip("mount -t tmpfs was refused here")
    try:
        _run_into(fs / "r")
    finally:
        subprocess.run(["umount", str(fs)], check=True)
