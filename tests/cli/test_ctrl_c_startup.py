"""Ctrl-C at any moment of `eigenhooks run`'s start-up: one line, exit code 130, never a traceback."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from eigenhooks.run import run


def _as_foreground() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as in a terminal (a background job ignores SIGINT)


@pytest.mark.parametrize("after", [0.3, 0.8, 1.5, 2.5])
def test_ctrl_c_while_starting_is_one_line(tmp_path, after):
    cmd = [sys.executable, "-m", "eigenhooks", "run", "--max-tokens", "64", "--out", str(tmp_path / "o")]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_as_foreground)
    time.sleep(after)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    lines = err.strip().splitlines()
    assert "Traceback" not in err and len(lines) == 1, err
    assert p.returncode == 130 and lines[0].startswith("eigenhooks: interrupted"), (p.returncode, err)


def test_an_interrupt_a_library_wrapped_is_an_interrupted_run(tmp_path, monkeypatch):
    from eigenhooks.zoo import loading

    def wrapped(*a, **k):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as e:  # as transformers' lazy import does
            raise RuntimeError("Could not import module 'GPT2LMHeadModel'") from e

    monkeypatch.setattr(loading, "load_model", wrapped)
    res = run("gpt2-tiny", max_tokens=64, out=tmp_path / "o", progress=False)
    assert res.status == "interrupted" and res.stage == "load"
    assert (
        not (tmp_path / "o").exists()
        or json.loads((tmp_path / "o" / "meta.json").read_text())["status"] == "interrupted"
    )
