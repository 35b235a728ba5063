"""A hand-edited or damaged state is refused on load and on merge: types, signs and finiteness, field named."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import eigenhooks as eh
from eigenhooks.monitor.measures import TGT_FIELDS

TEXTS = ["def f(x):\n    return x + 1", "class A:\n    pass"]
N = TGT_FIELDS.index("n")
pytestmark = pytest.mark.filterwarnings("ignore:no forward pass reached:UserWarning")


@pytest.fixture(scope="module")
def measured():
    """(model, tokenizer, a state of gpt2-tiny on two texts)."""
    model, tok = eh.zoo.load("gpt2-tiny")
    with eh.monitor(model) as mon, torch.no_grad():
        for t in TEXTS:
            model(**tok([t], return_tensors="pt"))
    return model, tok, json.loads(json.dumps(mon.state_dict()))


def _edited(state, layer: str, key: str, at: tuple, value):
    s = copy.deepcopy(state)
    row = s["layers"][layer][key]
    for j in at[:-1]:
        row = row[j]
    row[at[-1]] = value
    return s


CASES = [
    ("0", "tgt", (0, N), -991.0, r"layer 0, 'tgt', field 'n' of target 'ov/modulus': -991\.0 is negative"),
    ("1", "tgt", (1, N), float("nan"), r"layer 1, 'tgt', field 'n' of target 'ov/residual': nan is not finite"),
    ("2", "tgt", (0, TGT_FIELDS.index("sum_pre")), float("inf"), r"field 'sum_pre' of target 'ov/modulus': inf"),
    ("0", "null_up", (0, 3), -1.0, r"layer 0, 'null_up', entry \[0, 3\]: -1\.0 is negative"),
    ("0", "eig_up", (0, 0), float("inf"), r"layer 0, 'eig_up', entry \[0, 0\]: inf is not finite"),
    ("3", "tgt", (0, N), True, r"layer 3, 'tgt': holds true/false values"),
]


@pytest.mark.parametrize("layer, key, at, value, match", CASES)
@pytest.mark.parametrize("how", ["load", "merge"])
def test_an_edited_state_is_refused_with_the_field_named(measured, layer, key, at, value, match, how):
    model, _, state = measured
    bad = _edited(state, layer, key, at, value)
    with eh.monitor(model) as mon:
        before = mon.state_dict()
        with pytest.raises(ValueError, match=match):
            mon.load_state_dict(bad) if how == "load" else mon.merge_state_dict(bad)
        assert mon.state_dict() == before  # a refused state changes nothing


def test_signed_sums_may_be_negative_and_a_whole_state_merges(measured):
    model, _, state = measured
    signed = _edited(state, "0", "tgt", (0, TGT_FIELDS.index("sum_delta")), -3.5)
    with eh.monitor(model) as mon:
        mon.merge_state_dict(state)
        mon.merge_state_dict(signed)
        assert mon.summary()["n_tokens"].min() > 0
