"""torchrun with 2 gloo processes gives the single-process run: same tokens, same statistics."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pandas as pd
import pytest

from eigenhooks.run import run


@pytest.mark.skipif(
    shutil.which("torchrun") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "torchrun")),
    reason="torchrun not installed",
)
def test_torchrun_two_ranks_equal_one_process(tmp_path):
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
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
