"""The monitor prints short (issue 50): one line naming the model's class, the layers and targets
measured, the forwards and tokens counted and whether the block is active; a small HTML table for a
notebook. Printing reduces nothing: buffered decode steps stay buffered."""

from __future__ import annotations

import pytest
import torch

import eigenhooks as eh

TARGETS = [("ov", "modulus"), ("ov_ln", "modulus")]


@pytest.fixture(scope="module")
def gpt2():
    return eh.zoo.load("gpt2-tiny")


def _short(text: str) -> None:
    assert len(text.splitlines()) <= 3 and len(text) <= 200, text
    assert " object at 0x" not in text


def test_the_repr_names_the_model_layers_targets_and_counts(gpt2):
    model, tok = gpt2
    mon = eh.monitor(model, targets=TARGETS)
    text = repr(mon)
    _short(text)
    assert text.startswith("Monitor(GPT2LMHeadModel, 4 layers × 2 targets [ov/modulus, ov_ln/modulus]"), text
    assert "0 forwards" in text and "0 tokens" in text and "not entered" in text
    batch = tok(["def f(x): return x", "a = 1"], return_tensors="pt", padding=True)
    n_valid = int(batch["attention_mask"].sum())
    with mon:
        assert repr(mon).endswith("active)")
        model(**batch)
        text = repr(mon)
        _short(text)
        assert "1 forward," in text and f"{n_valid} tokens" in text, text
        model(**batch)
        assert f"2 forwards, {2 * n_valid} tokens" in repr(mon)
    assert repr(mon).endswith("closed)")
    assert mon.summary()["n_tokens"].iloc[0] == 2 * n_valid  # the repr's count is the table's


def test_head_targets_count_their_heads_and_many_names_are_cut(gpt2):
    model, _ = gpt2
    custom = [(f"c{i}", torch.linalg.qr(torch.randn(model.config.n_embd, 1, dtype=torch.float64))[0]) for i in range(5)]
    text = repr(eh.monitor(model, targets=[("ov_head", "modulus"), *custom]))
    _short(text)
    assert "× 9 targets [ov_head/modulus (4 heads), c0, c1, …]" in text, text


def test_printing_during_generate_reduces_nothing(gpt2):
    model, tok = gpt2
    with eh.monitor(model) as mon:
        model.generate(**tok(["def f(x):"], return_tensors="pt"), max_new_tokens=4, do_sample=False)
        buffered = len(mon._acc.buf)  # decode steps kept for one stacked reduction
        text = repr(mon)
        assert len(mon._acc.buf) == buffered, "the repr flushed the buffered steps"
    if buffered:
        assert f"+ {buffered} step" in text and "buffered" in text, text
    assert "4 forwards" in text  # the prompt and 3 decode steps (the 4th token needs no forward)
    assert f"{int(mon.summary()['n_tokens'].iloc[0])} tokens, closed" in repr(mon)


def test_the_html_is_a_small_table(gpt2):
    model, tok = gpt2
    with eh.monitor(model, targets=TARGETS) as mon:
        model(**tok(["x = <1>"], return_tensors="pt"))
    page = mon._repr_html_()
    assert page.count("<table") == 1 and page.count("<tr>") <= 8 and len(page) < 2000
    assert "GPT2LMHeadModel" in page and "ov_ln/modulus" in page and "&lt;" not in page
    assert "summary()" in page
