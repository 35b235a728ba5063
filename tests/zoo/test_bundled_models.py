"""The bundled models: offline, tiny, really trained, within the size budget."""

import pytest
import torch

import eigenhooks as eh


@pytest.mark.parametrize("name", eh.zoo.TINY)
def test_zoo_model_loads_offline_and_is_trained(name):
    model, tok = eh.zoo.load(name)
    cfg = model.config
    layers = getattr(cfg, "n_layer", None) or cfg.num_hidden_layers
    width = getattr(cfg, "n_embd", None) or cfg.hidden_size
    assert layers >= 4 and width >= 128
    card = eh.zoo.card(name)
    assert card["held_out_loss_trained"] < card["held_out_loss_untrained"] - 1.0
    ids = tok("def f(x):\n    return x", return_tensors="pt")
    with torch.no_grad():
        out = model(**ids)
    assert out.logits.shape[-1] == cfg.vocab_size and torch.isfinite(out.logits).all()
    for r in eh.verify(model):
        assert r.rel_diff < 1e-5  # float32 weights


def test_albert_zoo_shares_one_layer():
    model, _ = eh.zoo.load("albert-tiny")
    ad = eh.get_adapter(model)
    assert ad.shared_groups() == [[0, 1, 2, 3]]


def test_zoo_size_budget():
    total = sum(f.stat().st_size for f in eh.zoo.ZOO_DIR.rglob("*") if f.is_file() and "__pycache__" not in f.parts)
    assert total < 20 * 2**20, f"zoo is {total / 2**20:.1f} MB"


def test_training_script_is_seeded_and_runs(tmp_path):
    """A few steps of the real training script, twice: same losses both times. The held-out loss on 2 blocks,
    not the card's 32 (64 of the 67 forwards, 35 s of this test at load 3-4)."""
    from eigenhooks.zoo.train import train

    a = train("gpt2-tiny", steps=3, out=tmp_path / "a", batch=2, block=32, eval_blocks=2)
    b = train("gpt2-tiny", steps=3, out=tmp_path / "b", batch=2, block=32, eval_blocks=2)
    assert a["final_train_loss_ema"] == b["final_train_loss_ema"]
    assert a["held_out_loss_trained"] == b["held_out_loss_trained"] != a["held_out_loss_untrained"]
    assert (tmp_path / "a" / "gpt2-tiny" / "model.safetensors").exists()
