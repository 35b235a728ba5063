"""Invariance to batching: the same sequences give the same summary, every column, at the default settings.

The null subsample is chosen by each token's index among its own sequence's valid tokens (with the
cache offset under ``generate``), not by where it sits in a batch. So running the sequences one at a
time, batched with right or left padding, sharded over two monitors and merged (as ranks are), or
generated with a KV cache, gives one summary. The model runs in float64 so that the activations
themselves agree across batch layouts to ~1e-15; the monitor's sums are float32.
"""

import numpy as np
import pandas as pd
import pytest
import torch

import eigenhooks as eh
from eigenhooks.monitor.verdict import SAMPLE_COLUMNS

TEXTS = [
    "def f(x):\n    return x + 1",
    "class A:\n    pass",
    "for i in range(10): print(i)",
    "import os, sys\nprint(sys.argv[1:])",
    "x = {k: v for k, v in zip('abc', range(3))}",
]


@pytest.fixture(scope="module")
def gpt2():
    model, tok = eh.zoo.load("gpt2-tiny", dtype=torch.float64)
    return model, tok


def _run(model, batches, **kw):
    with eh.monitor(model, **kw) as mon, torch.no_grad():
        for b in batches:
            model(**b)
    return mon


def _batch(tok, texts, side):
    tok.padding_side = side
    b = tok(texts, return_tensors="pt", padding=True)
    b["position_ids"] = (b["attention_mask"].cumsum(-1) - 1).clamp_min(0)  # GPT-2 does not derive them itself
    tok.padding_side = "right"
    return b


# Δγ (the verdict's statistic) is a difference of float32 alignment means, so the order of the sums shows
# in it at their rounding (~1e-9 absolute on values ~1e-4), and in what is read from it
DGAMMA = ("dgamma", "null_dgamma_mean", "null_dgamma_sd", "null_dgamma_lo", "null_dgamma_hi", "dgamma_lift")
DGAMMA_TOL = {**{c: (1e-4, 1e-7) for c in DGAMMA + ("detectable_dgamma",)}, "p_null": (1e-4, 0), "q_null": (1e-4, 0)}


def assert_same_summary(a: pd.DataFrame, b: pd.DataFrame, skip=()):
    assert list(a.columns) == list(b.columns) and len(a) == len(b) > 0
    for col in a.columns:
        if col in skip:
            continue
        x, y = a[col].to_numpy(), b[col].to_numpy()
        if x.dtype.kind in "fc" or y.dtype.kind in "fc":
            x, y = x.astype(float), y.astype(float)
            assert np.array_equal(np.isnan(x), np.isnan(y)), col
            rtol, atol = DGAMMA_TOL.get(col, (1e-6, 1e-9))
            assert np.allclose(x[~np.isnan(x)], y[~np.isnan(y)], rtol=rtol, atol=atol), (col, x, y)
        else:
            assert (x == y).all(), (col, x, y)


@pytest.fixture(scope="module")
def alone(gpt2):
    model, tok = gpt2
    return _run(model, [tok([t], return_tensors="pt") for t in TEXTS]).summary()


@pytest.mark.parametrize("side", ["right", "left"])
def test_batched_with_padding_equals_one_at_a_time(gpt2, alone, side):
    model, tok = gpt2
    got = _run(model, [_batch(tok, TEXTS, side)]).summary()
    assert_same_summary(alone, got)
    assert set(alone["null_tokens"]) != {0}  # the nulls were measured (on every 5th token of each sequence)


def test_batches_of_other_sizes_equal_one_at_a_time(gpt2, alone):
    model, tok = gpt2
    got = _run(model, [_batch(tok, TEXTS[:2], "right"), _batch(tok, TEXTS[2:], "left")]).summary()
    assert_same_summary(alone, got)


def test_sharded_and_merged_equals_one_at_a_time(gpt2, alone):
    """Two ranks' monitors (as torchrun shards the data), merged: the same summary."""
    model, tok = gpt2
    r0 = _run(model, [_batch(tok, TEXTS[0::2], "right")])
    r1 = _run(model, [_batch(tok, TEXTS[1::2], "left")])
    r0.merge_state_dict(r1.state_dict())
    assert_same_summary(alone, r0.summary())


def test_generated_with_a_kv_cache_equals_one_forward_of_the_sequence(gpt2):
    """generate's prompt forward plus single-token steps vs one forward of what they saw.

    Consensus is a within-forward statistic (a KV-cache step sees one token of each sequence), so
    its columns may differ; so may the verdict's, whose kept tokens are chosen by each sequence's id, the
    content of its first forward (generate's is the prompt; the one forward's, the whole sequence:
    docs/concepts.md, "The verdict's tokens"). Every other column, the Haar nulls included, is equal."""
    model, tok = gpt2
    tok.padding_side = "left"
    prompts = tok(TEXTS[:3], return_tensors="pt", padding=True)
    tok.padding_side = "right"
    with eh.monitor(model) as mon, torch.no_grad():
        seq = model.generate(**prompts, max_new_tokens=9, do_sample=False, pad_token_id=tok.eos_token_id)
    seen = seq[:, :-1]  # the last generated token is never fed back
    mask = torch.cat(
        [
            prompts["attention_mask"],
            torch.ones(len(seen), seen.shape[1] - prompts["input_ids"].shape[1], dtype=torch.long),
        ],
        1,
    )
    full = {"input_ids": seen, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp_min(0)}
    ref = _run(model, [full]).summary()
    cons = [c for c in ref.columns if c.startswith("consensus") or c == "n_seq" or c in SAMPLE_COLUMNS]
    assert_same_summary(ref, mon.summary(), skip=cons)
    assert (mon.summary()["n_tokens"] == int(mask.sum())).all()


def test_a_batch_layout_that_changed_the_old_flat_grid_keeps_the_nulls(gpt2):
    """Regression for the old rule (every 5th token of the forward's flat b*n grid): with sequences of
    7 tokens, row 1 of a batch started at flat index 7 and took positions 3, 8 of its sequence,
    while alone it takes 0, 5. The null columns now agree."""
    model, _ = gpt2
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (3, 7), generator=g)
    one = _run(model, [{"input_ids": ids[i : i + 1]} for i in range(3)]).summary()
    batched = _run(model, [{"input_ids": ids}]).summary()
    for col in (
        "null_tokens",
        "rho_null_tokens",
        "null_rho_lo",
        "null_rho_hi",
        "rho_percentile",
        "p_null",
        "eig_rank",
        "fnull_percentile",
        "lift",
    ):
        x, y = one[col].to_numpy(float), batched[col].to_numpy(float)
        assert np.allclose(x, y, rtol=1e-6, atol=1e-9, equal_nan=True), col
