"""The verdict's sample stays where the readings are (issue 57): an engine's state is read back without it, and
the table's verdict columns are computed where it is (``accumulate.RemoteSample``), so the user's process holds
neither. Here, without an engine: a worker's record fed flat batches, and a user-side monitor that asks it for
its columns through the rpc's wire form; its table and its whole state equal those of the same state read back
whole, every column (its plan without null frames: ``Monitor.states_only``), and after the session stops
(``KeptVerdict``) as before."""

from __future__ import annotations

import dataclasses
import json

import pandas as pd
import pytest
import torch

import eigenhooks as eh
from eigenhooks.engines.requests import EngineRecord, TokenMap
from eigenhooks.engines.vllm.session import CheckpointAdapter, verdict_from_wire, verdict_to_wire
from eigenhooks.models import Adapter
from eigenhooks.monitor.accumulate import RemoteSample
from eigenhooks.monitor.verdict.sample import Sample, as_text

SETTINGS = {"null_draws": 8, "null_stride": 2, "verdict_draws": 99, "verdict_tokens": 64}


@pytest.fixture(scope="module")
def worker():
    """A tiny Llama and a worker's record of 24 requests (enough sequences for a verdict in each half)."""
    from tests.engines.test_requests import readings_of, tiny_llama

    model = tiny_llama()
    mon = eh.Monitor(model, attach=False, **SETTINGS)
    adapter = CheckpointAdapter(**{f.name: getattr(mon.adapter, f.name) for f in dataclasses.fields(Adapter)})
    record, _ = mon.record_spec().attach(adapter)
    eng = EngineRecord(record)
    g = torch.Generator().manual_seed(5)
    for r in range(24):
        ids = torch.randint(0, 64, (int(torch.randint(6, 20, (1,), generator=g)),), generator=g).tolist()
        eng.forward(readings_of(model, ids), TokenMap([f"r{r}"], [len(ids)], [0]))
    eng.end([f"r{r}" for r in range(24)])
    return model, eng


def remote(eng: EngineRecord, asked: list) -> RemoteSample:
    """What the user's process holds: calls that cross as the rpc's plain data (JSON-able but for bytes)."""

    def columns(blocks):
        asked.append(dict(blocks))
        return verdict_from_wire(verdict_to_wire(eng.verdict({int(i): int(b) for i, b in blocks.items()})))

    return RemoteSample(SETTINGS["verdict_tokens"], columns, eng.sample)


def test_the_table_and_state_equal_those_read_back_whole(worker):
    model, eng = worker
    whole = eh.Monitor(model, attach=False, **SETTINGS)
    whole.load_state_dict(eng.state_dict())
    lean_state = eng.state_dict(sample=False)
    assert "sample" not in lean_state
    asked = []
    user = eh.Monitor(model, attach=False, **SETTINGS).states_only()  # no null frames: the worker projects
    user.load_state_dict(lean_state, sample=remote(eng, asked))
    for lp in user._plan.layers.values():  # no null frame holds memory here: shapes alone
        b = lp.bases
        leaves = [f for v in b.frames.values() for f in (v.values() if isinstance(v, dict) else [v])]
        assert leaves and b.Bn64 is None and all(f.is_meta for f in leaves)
    want, got = whole.summary(), user.summary()
    assert want["verdict_sequences"].min() >= 10 and want["p_tilt"].notna().all()
    pd.testing.assert_frame_equal(got, want)  # every column, the verdict's and detectable_tilt included
    n = len(asked)
    pd.testing.assert_frame_equal(user.summary(), want)
    assert len(asked) == n  # the columns of one state are asked for once
    state = user.state_dict()  # the whole state: the sample crosses now, as the same JSON-able text
    assert json.dumps(state["sample"]) == json.dumps(whole.state_dict()["sample"])
    again = eh.Monitor(model, attach=False, **SETTINGS)
    again.load_state_dict(state)
    pd.testing.assert_frame_equal(again.summary(), want)
    with pytest.raises(RuntimeError, match=r"only reads states back \(states_only\(\)"):
        user.__enter__()
    with pytest.raises(RuntimeError, match="make another eh.monitor to measure here"):
        user.fwd_hooks()


def test_a_stopped_sessions_kept_verdict_gives_the_same_columns(worker):
    model, eng = worker
    kept = eng.kept_verdict()
    blocks = {0: 1, 1: 3}  # more draws on one layer, as the summary's second pass asks
    live = eng.verdict(blocks)
    assert kept.verdict(blocks).keys() == live.keys() == {0, 1}
    for i in live:
        for a, b in zip(kept.verdict(blocks)[i], live[i]):
            assert a.keys() == b.keys() and a["verdict_draws"] == SETTINGS["verdict_draws"] * blocks[i]
            torch.testing.assert_close(a["_null"], b["_null"], rtol=0, atol=0)
            assert {k: v for k, v in a.items() if k != "_null"} == {k: v for k, v in b.items() if k != "_null"}


def test_raw_bytes_and_base64_carry_the_same_sample(worker):
    _, eng = worker
    raw = eng.sample()
    assert all(isinstance(v["data"], bytes) for buf in raw["layers"].values() for v in buf.values())
    R = SETTINGS["verdict_tokens"]
    a, b = Sample.from_dict(raw, R), Sample.from_dict(as_text(raw), R)
    for i in a.layers:
        for k in ("keys", "seq", "pos", "X"):
            torch.testing.assert_close(a.layers[i][k], b.layers[i][k], rtol=0, atol=0, equal_nan=True)


def test_merging_into_a_monitor_whose_sample_is_elsewhere_brings_it_here(worker):
    model, eng = worker
    whole = eh.Monitor(model, attach=False, **SETTINGS)
    whole.load_state_dict(eng.state_dict())
    whole.merge_state_dict(eng.state_dict())
    user = eh.Monitor(model, attach=False, **SETTINGS).states_only()
    user.load_state_dict(eng.state_dict(sample=False), sample=remote(eng, []))
    user.merge_state_dict(eng.state_dict())
    pd.testing.assert_frame_equal(user.summary(), whole.summary())
