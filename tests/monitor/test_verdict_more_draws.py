"""A call that hangs on the verdict's draws is made again on more of them (docs/concepts.md, "The verdict").

p is a rank among K draws, so a q near 0.05 can go either way on another ``null_seed``. ``summary()`` scores the
layers of such rows again on ``verdict.EXTEND`` x K draws (the first K the same) and computes q again; every other
row keeps its K draws. Checked against a table made with the extension switched off.
"""

from __future__ import annotations

import math

import pytest
import torch

import eigenhooks as eh
from eigenhooks.monitor import verdict as V
from eigenhooks.monitor.verdict import layer_columns


def test_unsure_is_a_q_within_monte_carlo_error_of_the_line():
    K = 4999
    assert V.unsure(0.004, 0.06, K)  # r = 10 draws past the target: a 30% error, q 20% from 0.05
    assert not V.unsure(0.004, 0.5, K) and not V.unsure(4e-4, 0.001, K)
    assert not V.unsure(0.04, 0.06, 10 * 49_999)  # r = 10,000: a 1% error, q 20% away
    assert not V.unsure(math.nan, math.nan, K) and not V.unsure(0.01, math.nan, K)


def _layer(seed=0, n_seq=24, per=20, d=16):
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(d, generator=g) * 2
    seq = torch.arange(n_seq).repeat_interleave(per)
    X = torch.randn(n_seq * per, 2, d, generator=g) + mean
    return {"X": X / X.norm(dim=-1, keepdim=True), "seq": seq}


class _Target:
    def __init__(self, U):
        self.U, self.k, self.eig = U, U.shape[1], []


def test_more_blocks_keep_the_first_blocks_draws():
    """The draws of ``blocks`` = 3 begin with those of ``blocks`` = 1: extending adds draws, it does not redraw."""
    h = _layer()
    t = _Target(torch.linalg.qr(torch.randn(16, 2, generator=torch.Generator().manual_seed(5)))[0])
    config = type("C", (), {"verdict_draws": 99, "sample_seed": 0})()
    one = layer_columns(h, [t], config, seed=3)[0]
    three = layer_columns(h, [t], config, seed=3, blocks=3)[0]
    assert one["verdict_draws"] == 99 and three["verdict_draws"] == 297
    assert torch.equal(three["_null"][:99], one["_null"]) and not torch.equal(three["_null"][99:198], one["_null"])
    assert three["tilt"] == one["tilt"] and three["tilt_ci_lo"] == one["tilt_ci_lo"]  # the target is scored alike


def test_an_extension_scores_the_first_block_once(monkeypatch):
    """Extending a layer adds blocks to the first one, whose scores the caller kept (``first``): the columns
    equal those computed from scratch, bit for bit, and the null is drawn and scored on the new blocks only."""
    h = _layer(seed=2)
    g = torch.Generator().manual_seed(6)
    ts = [_Target(torch.linalg.qr(torch.randn(16, k, generator=g))[0]) for k in (1, 2, 2)]
    config = type("C", (), {"verdict_draws": 99, "sample_seed": 0})()
    fresh = layer_columns(h, ts, config, seed=4, blocks=4)
    first: dict = {}
    layer_columns(h, ts, config, seed=4, first=first)
    assert sorted(first) == [1, 2]  # one stream a subspace width
    drawn = []
    family = V.NULLS["covariance"]
    monkeypatch.setattr(family, "draws", lambda *a, _d=family.draws: drawn.append(a[2]) or _d(*a))
    more = layer_columns(h, ts, config, seed=4, blocks=4, first=first)
    assert len(drawn) == 2 * 3  # 3 new blocks of each width, the first of each not drawn again
    for a, b in zip(fresh, more):
        assert a.keys() == b.keys()
        for c in a:
            assert torch.equal(a[c], b[c]) if c == "_null" else (a[c] == b[c] or (a[c] != a[c] and b[c] != b[c])), c


@pytest.fixture(scope="module")
def gpt2():
    return eh.zoo.load("gpt2-tiny")


def test_the_rows_near_the_line_and_only_they_get_more_draws(gpt2, monkeypatch):
    model, _ = gpt2
    ids = torch.randint(0, 1000, (24, 40), generator=torch.Generator().manual_seed(1))
    with eh.monitor(model, null_stride=1, verdict_draws=99) as mon, torch.no_grad():
        model(input_ids=ids)
    monkeypatch.setattr(V, "UNSURE", 0.0)  # the extension off: every row on 99 draws
    mon._acc.sample_version += 1
    fixed = mon.summary()
    monkeypatch.undo()
    mon._acc.sample_version += 1
    more = mon.summary()
    assert (fixed["verdict_draws"] == 99).all()
    want = {
        int(r.layer)
        for r in fixed.itertuples()
        if V.unsure(r.p_tilt, r.q_tilt, 99) or V.unsure(r.p_static, r.q_static, 99)
    }
    assert want, "no row near the line: the case no longer exercises the extension"
    got = set(more.loc[more["verdict_draws"] == 99 * V.EXTEND, "layer"].astype(int))
    assert got == want
    assert set(more.loc[more["verdict_draws"] == 99, "layer"].astype(int)) == set(fixed["layer"].astype(int)) - want
    stay = ~more["layer"].isin(want)
    for c in ("p_tilt", "p_static", "tilt", "static", "tilt_null_lo", "verdict_sequences"):
        assert more.loc[stay, c].tolist() == fixed.loc[stay, c].tolist(), c
    moved = more["layer"].isin(want)
    assert (more.loc[moved, "tilt"] == fixed.loc[moved, "tilt"]).all()  # the same effect, on more draws
