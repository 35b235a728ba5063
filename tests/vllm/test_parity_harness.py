"""The parity harness against itself: HF vs HF batched differently agrees; one token changed does not."""

from __future__ import annotations

import pytest
import torch
from parity import EXACT, Sequence, compare, differences, hf_model, hf_table

NEEDS_VLLM = False  # the harness is HF only: it runs in every environment

OPTS = dict(null_draws=49, null_seed=0, null_stride=2)  # ~100 null tokens: p is defined


@pytest.fixture(scope="module")
def model_and_seqs(tiny_llama):
    g = torch.Generator().manual_seed(1)
    lengths = [40, 17, 64, 33, 50]
    seqs = [Sequence(f"r{i}", tuple(torch.randint(1, 1024, (n,), generator=g).tolist())) for i, n in enumerate(lengths)]
    return hf_model(tiny_llama), seqs


@pytest.fixture(scope="module")
def one_by_one(model_and_seqs):
    model, seqs = model_and_seqs
    return hf_table(model, seqs, batch_size=1, **OPTS)


def test_batching_does_not_change_the_table(model_and_seqs, one_by_one):
    model, seqs = model_and_seqs
    assert one_by_one["n_tokens"].iloc[0] == sum(len(s.token_ids) for s in seqs)
    assert one_by_one["n_sequences"].iloc[0] == len(seqs)
    assert one_by_one["p_null"].notna().all()  # enough null tokens: p is compared, not NaN against NaN
    compare(hf_table(model, seqs, batch_size=len(seqs), **OPTS), one_by_one)
    compare(hf_table(model, seqs[::-1], batch_size=2, **OPTS), one_by_one)


def test_one_token_changed_is_caught(model_and_seqs, one_by_one):
    model, seqs = model_and_seqs
    ids = list(seqs[2].token_ids)
    ids[5] = (ids[5] + 1) % 1024
    changed = [*seqs[:2], Sequence("r2", tuple(ids)), *seqs[3:]]
    diffs = differences(hf_table(model, changed, batch_size=len(seqs), **OPTS), one_by_one)
    assert diffs and "gamma" in diffs[0], diffs
    with pytest.raises(AssertionError, match=r"first: row \(0, 'ov/modulus'\), column gamma_"):
        compare(hf_table(model, changed, **OPTS), one_by_one)


def test_counts_and_missing_rows_are_caught(one_by_one):
    fewer = one_by_one.copy()
    fewer.loc[fewer.index[-1], "n_tokens"] -= 1
    assert any("column n_tokens" in d for d in differences(fewer, one_by_one))
    with pytest.raises(AssertionError, match=r"row \(1, 'ov/residual'\): missing"):
        compare(one_by_one.iloc[:-1], one_by_one)
    assert set(EXACT) <= set(one_by_one.columns)
    rho = one_by_one.copy()
    n = int(rho["n_tokens"].iloc[0])
    rho.loc[rho.index[0], "rho"] += 2.5 / n  # within 3 tokens' share
    assert not differences(rho, one_by_one)
    rho.loc[rho.index[0], "rho"] += 1 / n
    assert "column rho" in differences(rho, one_by_one)[0]
