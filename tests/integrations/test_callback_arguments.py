"""AlignmentCallback refuses bad arguments at construction, in one line; a string probe is one text."""

from __future__ import annotations

import math

import pytest
import torch

import eigenhooks as eh


@pytest.fixture(scope="module")
def gpt2():
    return eh.zoo.load("gpt2-tiny")


def test_a_string_probe_is_one_text(gpt2):
    model, tok = gpt2
    cb = eh.integrations.AlignmentCallback("abc def")
    one = eh.integrations.AlignmentCallback(["abc def"])
    values, want = cb.measure(model, tok), one.measure(model, tok)
    assert len(cb._batches) == 1 and cb._batches[0][0].shape == one._batches[0][0].shape
    assert cb._batches[0][0].shape[0] == 1  # one row, not seven one-character texts
    assert values == want


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"batch_size": 0}, r"batch_size must be a positive int, got 0"),
        ({"batch_size": -2}, r"batch_size must be a positive int, got -2"),
        ({"batch_size": 2.5}, r"batch_size must be a positive int, got 2\.5"),
        ({"max_length": 0}, r"max_length must be a positive int, got 0"),
        ({"max_length": -1}, r"max_length must be a positive int, got -1"),
        ({"every_n_steps": math.nan}, r"every_n_steps must be a positive int or None .*got nan"),
        ({"every_n_steps": math.inf}, r"every_n_steps must be a positive int or None .*got inf"),
        ({"every_n_steps": True}, r"every_n_steps must be a positive int or None .*got True"),
        ({"batch_size": "8"}, r"batch_size must be a positive int, got '8'"),
    ],
)
def test_bad_sizes_are_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        eh.integrations.AlignmentCallback(["a text"], **kwargs)


@pytest.mark.parametrize(
    "probe, match",
    [
        ([{"text": 5}], r"probe row 0: 'text' must be a string, got int"),
        ([{"input_ids": "abc"}], r"probe row 0: 'input_ids' must be a list of token ids \(ints\), got str"),
        ([{"input_ids": [1, 2]}, {"input_ids": [1.5, 2]}], r"probe row 1: 'input_ids' .* got float 1\.5"),
        ([{"input_ids": []}], r"probe row 0: 'input_ids' must be a non-empty list .* got an empty list"),
        ([{"input_ids": [1, 2], "attention_mask": [1]}], r"probe row 0: attention_mask has 1 entries, input_ids 2"),
        ({"input_ids": torch.ones(2, 3)}, r"input_ids must be an \(n, seq\) integer tensor"),
        (42, r"the probe must be a text, a list of texts .* got int"),
        (["ok", 3.5], r"a probe row must be a text or a mapping .* got float \(row 1\)"),
    ],
)
def test_probe_values_of_the_wrong_type_are_refused_at_construction(probe, match):
    with pytest.raises(TypeError, match=match):
        eh.integrations.AlignmentCallback(probe)


def test_every_n_steps_as_a_whole_float_still_works():
    assert eh.integrations.AlignmentCallback(["a"], every_n_steps=2.0).every_n_steps == 2
