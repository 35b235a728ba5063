"""benchmarks/gpu_check.py's device-agnostic parts, run on the CPU; and its no-CUDA exit.

The CPU runs here are also where gpu_check's low-precision tolerances come from: the
float16 / bfloat16 statistics of the same tokens on the CPU must sit inside ``TOL``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # spawned ranks import it by this name
    spec.loader.exec_module(mod)
    return mod


gc = _module()


@pytest.fixture(scope="module")
def tiny():
    model, tok = gc.load("gpt2-tiny", "cpu", torch.float32)
    ids = gc.fixed_ids(tok)
    return model, ids, gc.monitored_summary(model, ids)


def test_no_cuda_says_nothing_checked_and_exits_0(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OUT": str(tmp_path)}
    p = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "no CUDA device: nothing checked"
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == {"status": "no CUDA device: nothing checked"}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_statistics_within_tol_on_cpu(tiny, dtype):
    _, ids, ref = tiny
    d = gc.stats_check("gpt2-tiny", "cpu", dtype, ids, ref)
    print(f"gpt2-tiny {dtype} on CPU vs float32: " + gc._fmt(d))
    assert d["n_tokens_equal"] and d["finite"]
    assert d["worst_gamma"] > 0, d  # the low precision really ran
    assert d["worst_gamma"] <= gc.TOL[dtype][0] and d["worst_rho"] <= gc.TOL[dtype][1] and d["ok"], d


def test_stats_check_fails_on_other_tokens(tiny):
    """The comparison can fail: a reference from other tokens is far outside TOL."""
    model, ids, _ = tiny
    other = gc.monitored_summary(model, ids.roll(1, dims=0).flip(1))  # same tokens, other sequences
    d = gc.stats_check("gpt2-tiny", "cpu", torch.float16, ids, other)
    assert d["worst_gamma"] > gc.TOL[torch.float16][0] and d["worst_rho"] > gc.TOL[torch.float16][1], d
    assert not d["ok"]


def test_spectra_check_same_weights_agree_and_edited_weights_do_not(tiny):
    model, _, _ = tiny
    twin, _ = gc.load("gpt2-tiny", "cpu", torch.float32)
    d = gc.spectra_check(model, twin)
    assert d["ok"] and d["layers"] == 4 and d["lambda1_rel"] <= 1e-12 and d["subspace_dist"] <= 1e-12, d
    with torch.no_grad():
        twin.transformer.h[2].attn.c_proj.weight.mul_(1.01)  # F of layer 2 scaled by 1.01
    d = gc.spectra_check(model, twin)
    assert not d["ok"] and abs(d["lambda1_rel"] - 0.01) < 1e-5, d
    assert d["subspace_dist"] <= 1e-6, d  # a scaled F has the same eigenvectors (up to float32 rounding of w)
    with torch.no_grad():
        w = twin.transformer.h[1].attn.c_proj.weight
        w.add_(1e-2 * w.abs().mean() * torch.randn(w.shape, generator=torch.Generator().manual_seed(0)))
    d = gc.spectra_check(model, twin)
    assert not d["ok"] and d["subspace_dist"] > 1e-4, d  # a perturbed F turns its eigenvectors


def test_overhead_check_on_cpu(tiny):
    model, ids, _ = tiny
    d = gc.overhead_check(model, ids, reps=2)
    assert d["plain_s"] > 0 and d["monitored_s"] > 0 and 0.5 < d["ratio"] < 100, d


def test_reduce_check_two_gloo_ranks_equal_one_process():
    d = gc.reduce_check("gloo", 2, "cpu")
    assert d["n_tokens_equal"] and d["worst"] <= gc.REDUCE_TOL and d["ok"], d


def test_split_device_map_halves_the_blocks(tiny):
    model, _, _ = tiny
    dmap = gc.split_device_map(model, ["first", "second"])
    assert {k: v for k, v in dmap.items() if k.startswith("transformer.h.")} == {
        "transformer.h.0": "first",
        "transformer.h.1": "first",
        "transformer.h.2": "second",
        "transformer.h.3": "second",
    }
    outside = {k for k in dmap if not k.startswith("transformer.h.")}
    assert outside == {"transformer.wte", "transformer.wpe", "transformer.ln_f", "lm_head"}
    assert all(dmap[k] == "first" for k in outside)


def test_device_map_check_on_cpu(tiny):
    _, ids, _ = tiny
    d = gc.device_map_check("gpt2-tiny", ["cpu", "cpu"], ids)
    assert d["ok"] and d["worst"] == 0 and d["devices"] == ["cpu"], d


def test_errors_name_what_is_wrong(tiny):
    _, _, ref = tiny
    with pytest.raises(ValueError, match="has no ModuleList of blocks to split"):
        gc.split_device_map(torch.nn.Linear(2, 2), ["cpu", "cpu"])
    with pytest.raises(ValueError, match="summaries have different rows: 8 vs 7"):
        gc.compare_summaries(ref, ref.iloc[:-1])


@pytest.mark.real
def test_smollm2_low_precision_within_tol_on_cpu(smollm2):
    model, tok = smollm2
    ids = gc.fixed_ids(tok, batch=2, seq=64)
    ref = gc.monitored_summary(model, ids)
    for dtype in (torch.float16, torch.bfloat16):
        d = gc.stats_check(gc.SMOLLM, "cpu", dtype, ids, ref)
        print(f"smollm2 {dtype} on CPU vs float32: " + gc._fmt(d))
        assert d["worst_gamma"] > 0 and d["ok"], d


def test_dry_run_on_cpu_prints_every_check_and_writes_the_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gc.main(["--cpu", "--models", "gpt2-tiny", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    for line in (
        "PASS hooks gpt2-tiny float16 on cpu vs float32 CPU",
        "PASS hooks gpt2-tiny bfloat16 on cpu vs float32 CPU",
        "PASS spectra gpt2-tiny from cpu float32 weights vs CPU",
        "PASS spectra gpt2-tiny from cpu float16 weights vs CPU",
        "PASS monitored/plain gpt2-tiny 4x128 on cpu",
        "SKIP NCCL all_reduce: skipped: 0 GPU",
        "SKIP device_map across 2 GPUs: skipped: 0 GPU",
        "PASS gpu_check: 0 failed []",
    ):
        assert line in out, out
    figures = json.loads((tmp_path / "gpu_check.json").read_text())
    assert figures["stats/gpt2-tiny/bfloat16"]["ok"] is True and figures["overhead/gpt2-tiny"]["ratio"] > 0
