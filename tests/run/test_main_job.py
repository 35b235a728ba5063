"""The main job: run folder, plots, report (in a real browser), CLI errors, interruption."""

import json
import os
import shutil
import subprocess
import sys

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

import eigenhooks as eh
from eigenhooks.cli import app
from eigenhooks.run import run

runner = CliRunner()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    res = run("gpt2-tiny", max_tokens=600, batch_size=4, out=out, progress=False)
    assert not res.interrupted
    return out


def test_run_folder_contents(run_dir):
    for f in (
        "summary.csv",
        "summary.parquet",
        "spectra.json",
        "meta.json",
        "stats.jsonl",
        "report.html",
        "alignment_modulus.png",
        "alignment_residual.png",
        "eigenvalues.png",
        "heatmap.png",
    ):
        assert (run_dir / f).stat().st_size > 0, f
    df = pd.read_csv(run_dir / "summary.csv")
    assert len(df) == 8 and set(df["rank"]) == {"modulus", "residual"}
    assert (df["n_tokens"] == 600).all()
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["model"] == "gpt2-tiny" and meta["status"] == "complete" and meta["seed"] == 0
    assert meta["tokens_per_s"] > 0 and meta["world_size"] == 1 and meta["tokens_per_rank"] == [600]
    # the JSONL holds one line per forward, and its sums add up to the summary's counts
    lines = [json.loads(x) for x in (run_dir / "stats.jsonl").read_text().splitlines()]
    assert len(lines) == meta["forwards"]
    n = sum(s["n"] for line in lines for s in line["stats"] if s["layer"] == 0 and s["target"] == "ov/modulus")
    assert n == 600


def _direct_summary(max_tokens: int, batch_size: int, **monitor_kw):
    """What a monitor built by hand measures on the batches ``run`` feeds gpt2-tiny."""
    model, tok = eh.zoo.load("gpt2-tiny")
    from eigenhooks.run import load_texts, make_batches

    with eh.monitor(model, **monitor_kw) as mon, torch.no_grad():
        for ids in make_batches(tok, load_texts(), max_tokens, 128, batch_size):
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
    return mon.summary()


def test_run_summary_matches_a_direct_monitor(run_dir):
    df = pd.read_csv(run_dir / "summary.csv")
    direct = _direct_summary(600, 4)
    for col in ("gamma_pre", "gamma_mid", "rho", "null_gamma_pre_mean", "null_rho_lo", "p_null"):
        assert (df[col] - direct[col]).abs().max() < 1e-6, col


def test_report_rebuild(run_dir):
    (run_dir / "report.html").unlink()
    r = runner.invoke(app, ["report", str(run_dir)])
    assert r.exit_code == 0, r.output
    page = (run_dir / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 4 and "gamma_pre" in page


def _browser():
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def test_report_renders_in_headless_browser(run_dir):
    browser = _browser()
    if browser is None:
        pytest.skip("no chromium on this machine (.ci/run installs Debian's chromium); the report was not rendered")
    profile = run_dir / "chrome-profile"
    cmd = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=5000",
        "--dump-dom",
        (run_dir / "report.html").as_uri(),
    ]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    assert 'data-images-loaded="4/4"' in dom, dom[:500]


def test_plot_smoke(run_dir):
    import matplotlib

    matplotlib.use("Agg")
    from eigenhooks import plots

    fig = plots.trajectories(torch.randn(10, 3, 2).numpy())
    assert fig.axes


def test_cli_run_and_offline_errors(tmp_path):
    r = runner.invoke(app, ["run", "--max-tokens", "200", "--out", str(tmp_path / "r")])
    assert r.exit_code == 0, r.output
    assert "γ pre" in r.output and (tmp_path / "r" / "report.html").exists()
    assert "tokens/s" in r.output
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for args in (["run", "--dataset", "wikitext:test", "--max-tokens", "10"], ["run", "someone/some-model"]):
        p = subprocess.run(
            [sys.executable, "-m", "eigenhooks", *args, "--out", str(tmp_path / "x")],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert p.returncode == 1, p.stderr
        err = [x for x in p.stderr.strip().splitlines() if x.strip()]
        assert len(err) == 1 and err[0].startswith("eigenhooks: error:") and "Traceback" not in p.stderr, p.stderr


def test_run_with_lens_backend(tmp_path):
    pytest.importorskip("transformer_lens")
    res = run("gpt2-tiny", max_tokens=200, out=tmp_path / "lens", backend="lens", progress=False)
    assert (res.summary["n_tokens"] == 200).all() and (tmp_path / "lens" / "report.html").exists()
    hf = run("gpt2-tiny", max_tokens=200, out=tmp_path / "hf", progress=False)
    assert (res.summary["gamma_pre"] - hf.summary["gamma_pre"]).abs().max() < 1e-5


def test_cli_null_options_reach_the_monitor(tmp_path):
    args = ["--null-draws", "39", "--null-seed", "7", "--null-stride", "3", "--fnull-draws", "8", "--eig-top", "4",
            "--verdict-draws", "199", "--verdict-tokens", "256"]  # fmt: skip
    r = runner.invoke(app, ["run", "--max-tokens", "300", "--batch-size", "2", "--out", str(tmp_path / "r"), *args])
    assert r.exit_code == 0, r.output
    meta = json.loads((tmp_path / "r" / "meta.json").read_text())
    want = {"null_draws": 39, "null_seed": 7, "null_stride": 3, "fnull_draws": 8, "eig_top": 4,
            "verdict_draws": 199, "verdict_tokens": 256}  # fmt: skip
    assert meta["nulls"] == {**want, "sample_seed": 0}
    assert (pd.read_csv(tmp_path / "r" / "summary.csv")["verdict_draws"] == 199).all()
    df = pd.read_csv(tmp_path / "r" / "summary.csv")
    assert (df["null_draws"] == 39).all() and (df["null_seed"] == 7).all()
    direct = _direct_summary(300, 2, **want)  # a monitor built with these settings by hand, on the same batches
    for col in ("rho", "null_rho_lo", "null_rho_hi", "p_null", "eig_rank", "fnull_percentile"):
        assert ((df[col] - direct[col]).abs() < 1e-6).all(), col
    # with the defaults the floor is 2/129: these draws give another band
    default = run("gpt2-tiny", max_tokens=300, batch_size=2, out=tmp_path / "d", progress=False).summary
    assert not ((default["null_rho_lo"] - direct["null_rho_lo"]).abs() < 1e-9).all()


def test_cli_bad_null_option_is_one_line(tmp_path):
    r = runner.invoke(app, ["run", "--max-tokens", "50", "--null-draws", "0", "--out", str(tmp_path / "r")])
    assert r.exit_code == 1
    lines = [x for x in r.output.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "--null-draws must be a positive int, got 0" in lines[0], r.output
    assert not (tmp_path / "r").exists()  # refused before any work: no failed run folder left behind
    with pytest.raises(ValueError, match="unknown null settings"):
        run("gpt2-tiny", max_tokens=50, nulls={"null_drawz": 3}, out=tmp_path / "x", progress=False)
