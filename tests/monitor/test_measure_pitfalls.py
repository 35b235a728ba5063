"""The pitfalls a researcher's measure met when it was the engine's protocol (issue 48, item 4), each kept.

A measure written from the docs merged states of other directions silently, crashed deep in the
reduction or inside the forward under a built-in name, overwrote the built-in ``tgt`` (and then
refused the monitor's own state), crashed on ``row_fields``, repeated a per-layer value on every
target's row unsaid, and replaced ``p_null`` (and with it q_null and the verdict) by returning a
column of that name. Here each is a test: a clear error when the monitor is made, or its own names.
"""

from __future__ import annotations

import json

import pytest
import torch

import eigenhooks as eh

SETTINGS = dict(null_draws=8, fnull_draws=4, eig_top=2, null_stride=1, null_seed=3)
TEXTS = ["def f(x):\n    return x + 1", "The for statement iterates over a sequence."]


class Along(eh.Measure):
    """Sums of |<x, u>| / ||x|| at pre over the valid tokens, per unit direction u: a plain measure."""

    def __init__(self, name: str, D: torch.Tensor):
        self.name, self.D = name, torch.nn.functional.normalize(D.double(), dim=1)

    def sums(self, r):
        a = (r.pre @ self.D.to(r.pre).T).abs() / torch.linalg.vector_norm(r.pre, dim=-1, keepdim=True)
        return {"a": torch.where(r.valid[..., None], a, 0.0).sum((0, 1), dtype=torch.float64),
                "n": r.valid.sum(dtype=torch.float64)}  # fmt: skip

    def summary(self, sums, layer):
        return {"mean": float((sums["a"] / sums["n"]).mean())}


@pytest.fixture(scope="module")
def tiny():
    model, tok = eh.zoo.load("gpt2-tiny")
    return model, tok


def measured(tiny, measures, texts=TEXTS):
    model, tok = tiny
    mon = eh.monitor(model, targets=[("ov", "modulus"), ("ov", "residual")], measures=measures, **SETTINGS)
    with torch.no_grad(), mon:
        for t in texts:
            model(**tok([t], return_tensors="pt"))
    return mon


def D(seed: int) -> torch.Tensor:
    return torch.randn(3, 128, generator=torch.Generator().manual_seed(seed))


def test_states_of_other_directions_do_not_merge_by_default(tiny):
    """No ``fingerprint`` written: the default digests the measure's own tensors, class and name."""
    a = measured(tiny, [Along("along", D(0))])
    same = eh.monitor(tiny[0], targets=[("ov", "modulus"), ("ov", "residual")], measures=[Along("along", D(0))],
                      **SETTINGS)  # fmt: skip
    same.merge_state_dict(a.state_dict())  # the same directions: merged
    other = eh.monitor(tiny[0], targets=[("ov", "modulus"), ("ov", "residual")], measures=[Along("along", D(1))],
                       **SETTINGS)  # fmt: skip
    with pytest.raises(ValueError, match="measure:along"):
        other.merge_state_dict(a.state_dict())


@pytest.mark.parametrize("name", ["haar", "eig", "fnull", "target", "tgt", "null_up", "p_null", "rho", "q_null"])
def test_a_built_in_name_is_one_clear_error_when_the_monitor_is_made(tiny, name):
    with pytest.raises(ValueError, match=f"the name '{name}' is a built-in"):
        eh.monitor(tiny[0], measures=[Along(name, D(0))])


def test_two_measures_of_one_name_and_a_name_that_is_no_identifier_are_refused(tiny):
    with pytest.raises(ValueError, match="two measures are named 'a'"):
        eh.monitor(tiny[0], measures=[Along("a", D(0)), Along("a", D(1))])
    with pytest.raises(ValueError, match="identifier"):
        eh.monitor(tiny[0], measures=[Along("a.b", D(0))])
    with pytest.raises(ValueError, match="takes eh.Measure instances"):
        eh.monitor(tiny[0], measures=[object()])


def test_a_field_named_tgt_lives_under_its_name_and_the_own_state_loads(tiny):
    class Tgt(Along):
        def sums(self, r):
            return {"tgt": super().sums(r)["a"]}

        def summary(self, sums, layer):
            return {}

    with_it = measured(tiny, [Tgt("mine", D(0))])
    without = measured(tiny, [])
    sa, sb = with_it.state_dict()["layers"], without.state_dict()["layers"]
    for i in sb:
        assert sa[i]["tgt"] == sb[i]["tgt"] and len(sa[i]["mine.tgt"]) == 3
    again = eh.monitor(tiny[0], targets=[("ov", "modulus"), ("ov", "residual")], measures=[Tgt("mine", D(0))],
                       **SETTINGS)  # fmt: skip
    again.load_state_dict(with_it.state_dict())
    assert json.dumps(again.state_dict()["layers"]) == json.dumps(sa)  # NaN (no eigen-subspace) as NaN


def test_row_fields_are_no_part_of_a_measure():
    """The per-sequence counters are the engine's (``measures.base.Builtin``): a researcher's measure has none."""
    assert not {"row_fields", "rows", "columns", "align", "up", "no_mid"} & set(dir(eh.Measure))


def test_a_per_layer_value_is_said_to_be_per_layer(tiny):
    df = measured(tiny, [Along("along", D(0))]).summary()
    assert df.attrs["per_layer"] == ["along.mean"]
    per_layer = df.groupby("layer")["along.mean"].nunique()
    assert (per_layer == 1).all() and df.groupby("layer").size().min() == 2  # two targets, one value


def test_a_column_named_like_a_built_in_one_does_not_replace_it(tiny):
    """A summary returning p_null and rho gets them under its name; p_null, q_null and the verdict stay."""

    class Loud(Along):
        def summary(self, sums, layer):
            return {"p_null": 0.0, "rho": 1.0, "verdict": "toward"}

    a = measured(tiny, [Loud("loud", D(0))]).summary()
    b = measured(tiny, []).summary()
    for c in b.columns:
        assert a[c].equals(b[c]), c
    assert (a["loud.p_null"] == 0.0).all() and (a["loud.rho"] == 1.0).all()


def test_sums_that_change_their_fields_say_which_measure(tiny):
    class Fickle(Along):
        calls = 0

        def sums(self, r):
            Fickle.calls += r.pre.shape[1] > 0  # a forward's readings (zero sums: no tokens)
            out = super().sums(r)
            return out if Fickle.calls <= 1 else {"other": out["a"]}

    with pytest.raises(ValueError, match="measure 'fickle': sums returned \\['other'\\]"):
        measured(tiny, [Fickle("fickle", D(0))])
