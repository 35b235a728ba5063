"""The README's 'no pickle' paragraph says what a pytorch_model.bin folder gets, and that is what it gets."""

from __future__ import annotations

from pathlib import Path

import torch

import eigenhooks as eh

README = Path(__file__).resolve().parents[2] / "README.md"


def test_a_bin_only_folder_is_read_with_weights_only(tmp_path, monkeypatch):
    model, tok = eh.zoo.load("gpt2-tiny")
    model.config.save_pretrained(tmp_path)  # transformers 5 saves safetensors only: write the .bin as old ones were
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    tok.save_pretrained(tmp_path)
    assert (tmp_path / "pytorch_model.bin").is_file() and not list(tmp_path.glob("*.safetensors"))
    calls = []
    real_load = torch.load

    def recording(*a, **k):
        calls.append(k.get("weights_only"))
        return real_load(*a, **k)

    monkeypatch.setattr(torch, "load", recording)
    loaded, _ = eh.load_model(str(tmp_path))
    assert calls and all(w is True for w in calls), calls
    torch.testing.assert_close(loaded.state_dict()["lm_head.weight"], model.state_dict()["lm_head.weight"])


def test_the_readme_says_what_no_pickle_covers():
    text = " ".join(README.read_text().split())
    assert 'What "no pickle" covers.' in text
    assert "a folder with only `pytorch_model.bin` is a pickle file" in text
    assert "`torch.load(weights_only=True)`" in text and "trust_remote_code" in text
