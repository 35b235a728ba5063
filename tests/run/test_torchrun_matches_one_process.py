"""torchrun with 2 gloo processes gives the single-process run: same tokens, same statistics."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from eigenhooks.run import run

ROOT = Path(__file__).resolve().parents[2]

TORCHRUN = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
needs_torchrun = pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun not installed")


@needs_torchrun
def test_torchrun_two_ranks_equal_one_process(tmp_path):
    torchrun = TORCHRUN
    out = tmp_path / "dist"
    cmd = [
        torchrun,
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "eigenhooks",
        "run",
        "gpt2-tiny",
        "--max-tokens",
        "2048",
        "--out",
        str(out),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["world_size"] == 2 and all(t > 0 for t in meta["tokens_per_rank"])
    assert sum(meta["tokens_per_rank"]) == meta["n_tokens"] == 2048
    one = run("gpt2-tiny", max_tokens=2048, out=tmp_path / "one", progress=False).summary
    two = pd.read_csv(out / "summary.csv")
    assert (one["n_tokens"].to_numpy() == two["n_tokens"].to_numpy()).all()
    for col in ("gamma_pre", "gamma_mid", "gamma_post", "rho", "rho_ci_lo", "rho_ci_hi", "null_rho_lo", "p_null"):
        assert (one[col].to_numpy() - two[col].to_numpy()).__abs__().max() < 1e-5, col


@needs_torchrun
def test_torchrun_records_every_rank(tmp_path):
    """7 forwards on 2 ranks (4 + 3): meta.json counts 7 and stats.jsonl holds all 7 lines, each with its rank."""
    out = tmp_path / "dist"
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "eigenhooks", "run", "gpt2-tiny"]
    cmd += ["--max-tokens", "850", "--batch-size", "1", "--out", str(out)]  # 6 x 128 tokens, then 82
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["forwards"] == 7 and meta["forwards_per_rank"] == [4, 3]
    assert meta["tokens_per_rank"] == [3 * 128 + 82, 3 * 128]
    lines = [json.loads(x) for x in (out / "stats.jsonl").read_text().splitlines()]
    assert [(x["rank"], x["forward"]) for x in lines] == [(0, 1), (0, 2), (0, 3), (0, 4), (1, 1), (1, 2), (1, 3)]
    summary = pd.read_csv(out / "summary.csv")  # summed by Monitor.all_reduce, not from these lines
    for (layer, target), row in summary.set_index(["layer", "target"]).iterrows():
        n = sum(s["n"] for x in lines for s in x["stats"] if s["layer"] == layer and s["target"] == target)
        assert n == row["n_tokens"] == 850, (layer, target)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stray_env(**env: str) -> dict:
    """This environment without torchrun's variables, plus ``env``: a process that believes it is one of a group."""
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "GROUP_", "ROLE_", "LOCAL_"))}
    for k in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        keep.pop(k, None)
    return {**keep, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}


def _timed_lines(p: subprocess.Popen) -> list[tuple[float, str]]:
    """p's stderr lines with the time each came (read on a thread, so a hang cannot block the test)."""
    got: list[tuple[float, str]] = []
    t = threading.Thread(target=lambda: got.extend((time.monotonic(), x.rstrip("\n")) for x in p.stderr), daemon=True)
    t.start()
    return got


@pytest.mark.parametrize("rank", [0, 1])
def test_stray_distributed_variables_say_what_they_wait_for_and_time_out(tmp_path, rank):
    port, timeout = _free_port(), 4
    env = _stray_env(WORLD_SIZE="2", RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cmd = [sys.executable, "-m", "eigenhooks", "run", "--max-tokens", "64", "--dist-timeout", str(timeout)]
    p = subprocess.Popen(
        [*cmd, "--out", str(tmp_path / "o")], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    lines = _timed_lines(p)
    try:
        p.wait(timeout=90)
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError(f"still waiting after 90 s with --dist-timeout {timeout}; stderr: {lines}") from None
    time.sleep(0.2)  # the reader thread takes the last line
    err = [(t, x) for t, x in lines if x.strip()]
    assert p.returncode == 1 and len(err) == 2, err
    (t_wait, waiting), (t_error, error) = err
    assert waiting == f"eigenhooks: rank {rank}: waiting for 2 ranks at 127.0.0.1:{port} (--dist-timeout {timeout} s)"
    assert error.startswith(
        f"eigenhooks: error: rank {rank} of 2: no rendezvous at 127.0.0.1:{port} within --dist-timeout {timeout} s"
    )
    assert "unset WORLD_SIZE" in error and "torchrun" in error
    # the waiting line comes 1 s into the wait, the error at the timeout (the master's store counts whole seconds)
    assert timeout - 1.5 < t_error - t_wait < timeout + 1.5, t_error - t_wait
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "env, msg",
    [
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 asks for 2 processes, but RANK, MASTER_ADDR, MASTER_PORT are not set"),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
        ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, "RANK=2 is not in 0..1"),
    ],
)
def test_incomplete_distributed_variables_are_one_line(tmp_path, monkeypatch, env, msg):
    from typer.testing import CliRunner

    from eigenhooks.cli import app

    for k, v in _stray_env(**env).items():
        monkeypatch.setenv(k, v)
    for k in {"WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"} - set(env):
        monkeypatch.delenv(k, raising=False)
    r = CliRunner().invoke(app, ["run", "--max-tokens", "64", "--out", str(tmp_path / "o")])
    assert r.exit_code == 1 and msg in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("bad", ["0", "-3", "nan", "inf"])
def test_bad_dist_timeout_is_one_line(tmp_path, bad):
    from typer.testing import CliRunner

    from eigenhooks.cli import app

    r = CliRunner().invoke(app, ["run", "--dist-timeout", bad, "--out", str(tmp_path / "o")])
    assert r.exit_code == 1 and f"--dist-timeout must be a positive number of seconds, got {float(bad)}" in r.output
    assert len(r.output.strip().splitlines()) == 1, r.output
