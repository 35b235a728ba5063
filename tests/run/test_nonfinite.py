"""NaN in a model's weights: tokens left out for non-finite activations are said, and a run with none left fails."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import eigenhooks as eh
from eigenhooks.cli import app

runner = CliRunner()


def _nan_model(folder, layer: int):
    """gpt2-tiny saved with one NaN in layer ``layer``'s MLP weight."""
    model, tok = eh.zoo.load("gpt2-tiny")
    with torch.no_grad():
        model.transformer.h[layer].mlp.c_fc.weight[3, 5] = float("nan")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_nan_in_the_first_layer_leaves_no_token_and_fails(tmp_path):
    model = _nan_model(tmp_path / "nan0", 0)
    out = tmp_path / "run"
    r = runner.invoke(app, ["run", str(model), "--max-tokens", "64", "--out", str(out)])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1, r.output
    assert lines[0].startswith("eigenhooks: error: no token was measured: ")
    assert "NaN or inf activations were left out at 4 layer(s) (0, 1, 2, 3; up to 64 at layer 0)" in lines[0]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["status"] == "failed" and "no token was measured" in meta["error"]


def test_nan_in_a_later_layer_warns_with_the_layers(tmp_path):
    model = _nan_model(tmp_path / "nan2", 2)
    with pytest.warns(eh.MeasurementWarning, match=r"left out at 2 layer\(s\) \(2, 3; up to 64 at layer 2\)"):
        res = eh.run.run(str(model), max_tokens=64, out=tmp_path / "run", progress=False)
    assert res.status == "complete"
    assert res.summary.set_index("layer")["n_tokens"].to_dict() == {0: 64, 1: 64, 2: 0, 3: 0}


def test_a_whole_model_warns_nothing(tmp_path, recwarn):
    res = eh.run.run("gpt2-tiny", max_tokens=64, out=tmp_path / "run", progress=False)
    assert res.status == "complete"
    assert not [w for w in recwarn if issubclass(w.category, eh.MeasurementWarning)]
