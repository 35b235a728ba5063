"""A measure's name is never a column ``mon.summary()`` makes itself (docs/api.md promises a ValueError).

The reserved columns were a hand list, and 17 columns added since (``dgamma``, ``p_rho_mc``, ``detectable_rho``,
...) were missing from it (issue 58). They are now read off the measures' own summaries
(``own.builtin_columns``); here every column of real summaries (layer and head targets, a custom target, a
pre-norm and a post-norm model) must be among them, and each is refused as a measure's name.
"""

from __future__ import annotations

import pytest
import torch

import eigenhooks as eh
from eigenhooks.monitor.measures.own import builtin_columns, check


class Named(eh.Measure):
    def __init__(self, name: str):
        self.name = name

    def sums(self, r):
        return {"n": r.valid.sum().double()}

    def summary(self, sums, layer):
        return {"n": float(sums["n"])}


@pytest.fixture(scope="module")
def summaries():
    """Summary columns of gpt2-tiny (pre-norm; layer, head and custom targets) and albert-tiny (post-norm)."""
    out = []
    for name, targets in (("gpt2-tiny", [("ov", "modulus"), ("ov_head", "residual")]), ("albert-tiny", None)):
        model, tok = eh.zoo.load(name)
        d = model.config.hidden_size
        extra = [("mine", torch.eye(d, dtype=torch.float64)[:, :1])]
        kw = {"targets": (targets or [("ov", "modulus")]) + extra}
        with eh.monitor(model, null_draws=4, fnull_draws=2, eig_top=2, null_stride=1, **kw) as mon:
            model(**tok(["def f(x):\n    return x + 1"], return_tensors="pt"))
        out.append(mon.summary())
    return out


def test_every_column_a_summary_makes_is_reserved(summaries):
    made = set().union(*(df.columns for df in summaries))
    assert {"head", "rho_norm_only", "dgamma", "detectable_rho", "p_rho_mc"} <= made  # the cases were reached
    assert made - builtin_columns() == set(), "summary columns no measure may take, not reserved"


@pytest.mark.parametrize("name", ["dgamma", "p_rho_mc", "detectable_rho", "detectable_dgamma", "design_effect"])
def test_the_columns_added_since_the_hand_list_are_refused(name):
    model, _ = eh.zoo.load("gpt2-tiny")
    with pytest.raises(ValueError, match=rf"the name {name!r} is a built-in summary column's; give the measure"):
        eh.monitor(model, measures=[Named(name)])


def test_every_reserved_column_is_refused_and_a_free_name_is_not():
    for name in sorted(builtin_columns()):
        with pytest.raises(ValueError, match="built-in"):
            check([Named(name)])
    assert [m.name for m in check([Named("sae")])] == ["sae"]
