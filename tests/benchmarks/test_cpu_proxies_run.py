"""Smoke runs of the CPU proxies in benchmarks/ (their --quick modes): they run and print each figure
beside its goal. Not timed: the figures themselves are read from a full run (docs/scale.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_generate_host_quick():
    out = _run("generate_host.py", "--quick")
    for line in ("median paired ratio", "launching aten ops: +", "the CUDA path (", "monitor hook calls: ",
                 "Python function calls"):  # fmt: skip
        assert line in out, out
    assert out.count("goal <=") == 2, out


def test_kept_readings_quick():
    out = _run("kept_readings.py", "--quick")
    for mode in ("plain", "noop", "keep", "keep8", "copy"):
        assert f"  {mode} " in out, out
    assert "keep - noop:" in out, out


def test_model_kernels_quick():
    out = _run("model_kernels.py", "--quick")
    for k in ("linear", "cat", "scaled_dot_product_attention"):
        assert f"  {k} " in out, out
    assert out.count(" us a step") == 7, out
