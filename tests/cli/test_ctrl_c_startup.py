"""Ctrl-C at any moment of `eigenhooks run`'s start-up: one line, exit code 130, never a traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from eigenhooks.run import run


def _as_foreground() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as in a terminal (a background job ignores SIGINT)


def _started(p: subprocess.Popen, lines: list[str], ready: threading.Event) -> None:
    """Collect the child's stderr; ``ready`` once eigenhooks' start-up handler is set. PYTHONPROFILEIMPORTTIME
    prints a line as each import ends, and ``eigenhooks._startup`` sets the handler as its import's last act."""
    for line in p.stderr:
        lines.append(line)
        if line.startswith("import time:") and line.split("|")[-1].strip() == "eigenhooks._startup":
            ready.set()


@pytest.mark.parametrize("after", [0.0, 0.5, 1.5, 2.5])
def test_ctrl_c_while_starting_is_one_line(tmp_path, after):
    """Ctrl-C ``after`` seconds into the command's own start-up. Counted from when its handler is set, not from
    the process's birth: a Ctrl-C inside CPython's start-up (``init_import_site``, before any eigenhooks code
    runs) is Python's to print, and under load a fixed 0.3 s landed there."""
    cmd = [sys.executable, "-m", "eigenhooks", "run", "--max-tokens", "64", "--out", str(tmp_path / "o")]
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    p = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_as_foreground, env=env
    )
    lines: list[str] = []
    ready = threading.Event()
    reader = threading.Thread(target=_started, args=(p, lines, ready), daemon=True)
    reader.start()
    try:
        assert ready.wait(120), "the command never imported eigenhooks._startup: " + "".join(lines[-5:])
        time.sleep(after)
        p.send_signal(signal.SIGINT)
        p.wait(timeout=120)
    finally:
        p.kill()
        reader.join(10)
        p.stdout.close()
    err = "".join(line for line in lines if not line.startswith("import time:"))
    said = err.strip().splitlines()
    assert "Traceback" not in err and len(said) == 1, err
    assert p.returncode == 130 and said[0].startswith("eigenhooks: interrupted"), (p.returncode, err)


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


def _main(monkeypatch, *argv):
    from eigenhooks import cli

    monkeypatch.setattr(sys, "argv", ["eigenhooks", *argv])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    return exit_.value.code


def test_an_interrupt_typer_caught_is_said_in_one_line(monkeypatch, capsys):
    # typer turns a KeyboardInterrupt that reaches it (while it parses the flags, or from a command that
    # does not catch it) into exit 130 and prints nothing; CI's Ctrl-C at 1.5 s came while typer parsed
    from eigenhooks.zoo import store

    def interrupt(**_):
        raise KeyboardInterrupt

    monkeypatch.setattr(store, "clear_cache", interrupt)
    code = _main(monkeypatch, "cache", "clear")
    err = capsys.readouterr().err
    assert code == 130 and err.strip().splitlines() == ["eigenhooks: interrupted"], (code, err)


def test_an_interrupt_a_command_said_is_not_said_twice(monkeypatch, capsys):
    from eigenhooks import zoo

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(zoo, "fetch", interrupt)
    code = _main(monkeypatch, "fetch", "smollm2-135m")
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 130 and len(lines) == 1 and lines[0].startswith("eigenhooks: fetch of smollm2-135m interrupted")


def test_an_interrupt_a_destructor_caught_still_stops_the_command(monkeypatch, capsys):
    # CPython prints a KeyboardInterrupt raised in __del__ as "Exception ignored in ..." and drops it:
    # `eigenhooks verify` then ran on to rc 0 after a Ctrl-C that landed in regex's Group.__del__
    from eigenhooks.zoo import store

    class Destroyed:
        def __del__(self):
            raise KeyboardInterrupt

    def interrupted_while_working(**_):
        Destroyed()  # dropped at once: its KeyboardInterrupt is unraisable
        for _ in range(200):  # the command goes on working
            time.sleep(0.005)
        return []

    monkeypatch.setattr(store, "clear_cache", interrupted_while_working)
    code = _main(monkeypatch, "cache", "clear")
    err = capsys.readouterr().err
    assert code == 130 and err.strip().splitlines() == ["eigenhooks: interrupted"], (code, err)
    assert sys.unraisablehook.__module__ != "eigenhooks._startup"  # the hook it found is back


@pytest.mark.parametrize("late", [1.0, 3.0])
def test_a_destructors_interrupt_stops_the_command_however_late_its_thread_runs(monkeypatch, capsys, late):
    """On a loaded machine the thread that raises it again can run after the command ended (it failed
    so: rc 0, nothing said): the command still exits 130 in one line, and no interrupt comes later."""
    from eigenhooks import _startup
    from eigenhooks.zoo import store

    class Destroyed:
        def __del__(self):
            raise KeyboardInterrupt

    def interrupted_at_the_end(**_):
        Destroyed()  # the last thing the command does
        return []

    monkeypatch.setattr(_startup, "DELIVER_AFTER", late)
    monkeypatch.setattr(store, "clear_cache", interrupted_at_the_end)
    code = _main(monkeypatch, "cache", "clear")
    err = capsys.readouterr().err
    assert code == 130 and err.strip().splitlines() == ["eigenhooks: interrupted"], (code, err)
    time.sleep(late + 0.2)  # a timer left running would interrupt this test now
    assert not _startup.undelivered()
