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
