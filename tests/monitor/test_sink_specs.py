"""Sink specs that cannot work are refused at entry in our words: a TensorBoard folder under a file, a
finished wandb run."""

from __future__ import annotations

import pytest

import eigenhooks as eh


@pytest.fixture(scope="module")
def gpt2():
    return eh.zoo.load("gpt2-tiny")


def test_a_tensorboard_folder_under_a_file(gpt2, tmp_path):
    pytest.importorskip("torch.utils.tensorboard")
    afile = tmp_path / "afile"
    afile.write_text("x")
    spec = f"tensorboard:{afile}/sub"
    with pytest.raises(ValueError, match=rf"sink='{spec}': cannot make the folder {afile}/sub \(Not a directory\)"):
        eh.monitor(gpt2[0], sink=spec)


def test_a_finished_wandb_run(gpt2, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    for k, v in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(k, v)
    run = wandb.init(project="eigenhooks-test", dir=str(tmp_path))
    run.finish()
    try:
        with pytest.raises(
            ValueError, match=rf"the wandb run {run.id} given as sink is finished: log to an active run"
        ):
            eh.monitor(gpt2[0], sink=run)
    finally:
        wandb.teardown()
