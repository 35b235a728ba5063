"""Requests that share an id, monitors nested on one engine, and dummy forwards between steps: each request
counted exactly (issue 57).

vLLM accepts duplicate request ids and keeps them apart internally (``{id}-{8 random characters}``); the
monitor counts each request by that internal id, so two requests the user gave one id are two sequences,
two rows, each its own. Two monitors nested on one engine each count the forwards of their own block.
Tables are held to the HF monitor on the tokens the engine processed (tests/vllm/parity.py).
"""

from __future__ import annotations

import pytest
from parity import compare, hf_table, processed_tokens
from test_engine_monitor import OPT_IN, OPTS, greedy, prompts, shut
from tier import start_engine

import eigenhooks as eh


@pytest.fixture(scope="module")
def llm(tiny_llama):
    llm = start_engine(tiny_llama, enforce_eager=True, additional_config=OPT_IN)
    yield llm
    shut(llm)


def _run_by_hand(llm, items) -> list:
    """``llm_engine.add_request`` for each (request_id, prompt, params), stepped until all finish."""
    engine = llm.llm_engine
    for rid, prompt, params in items:
        engine.add_request(rid, prompt, params)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    return done


def test_requests_sharing_an_id_are_counted_each_as_its_own(llm, tiny_llama):
    ps = prompts([12, 17, 9], seed=11)
    with eh.monitor(llm, **OPTS) as mon:
        outs = _run_by_hand(llm, [("dup", ps[0], greedy(4)), ("dup", ps[1], greedy(6)), ("other", ps[2], greedy(3))])
    assert sorted(o.request_id for o in outs) == ["dup", "dup", "other"]
    seqs = processed_tokens(outs)
    compare(mon.summary(), hf_table(tiny_llama, seqs, **OPTS))
    assert int(mon.summary()["n_tokens"].iloc[0]) == (12 + 3) + (17 + 5) + (9 + 2)
    req = mon.requests()
    rows = req[(req.layer == 0) & (req.target == "ov/modulus")]
    dup = rows[rows.request_id == "dup"]
    assert len(dup) == 2 and dup["engine_id"].nunique() == 2  # two requests, told apart by the engine's id
    assert all(e.startswith("dup-") for e in dup["engine_id"])
    assert sorted(dup["n_tokens"]) == [15, 22] and (dup["sample"] == 0).all()
    assert dup["finished"].all() and (dup["recomputed"] == 0).all()


def test_nested_monitors_on_one_engine_each_count_their_own_block(llm, tiny_llama):
    first, inner, last = prompts([20, 11], seed=2), prompts([15], seed=3), prompts([8, 13], seed=4)
    with eh.monitor(llm, **OPTS) as outer:
        a = llm.generate(first, greedy(4))
        with eh.monitor(llm, **OPTS) as nested:
            b = llm.generate(inner, greedy(5))
        c = llm.generate(last, greedy(3))
    compare(nested.summary(), hf_table(tiny_llama, processed_tokens(b), **OPTS))
    compare(outer.summary(), hf_table(tiny_llama, processed_tokens(a + b + c), **OPTS))
    assert int(outer.summary()["n_sequences"].iloc[0]) == 5 and int(nested.summary()["n_sequences"].iloc[0]) == 1
    assert "closed" in repr(outer) and "closed" in repr(nested)


def test_a_dummy_forward_between_steps_loses_no_token(llm, tiny_llama):
    """Data parallel's idle ranks run a dummy forward whenever another rank has work (``execute_dummy_batch``):
    the taps write it, nothing drains it. Between two decoding steps of open requests it must count nothing
    and make no real forward look unwritten (the next one was dropped: ``dropped``, and 2 tokens short)."""
    ps = prompts([14, 10], seed=21)
    engine = llm.llm_engine
    with eh.monitor(llm, **OPTS) as mon:
        engine.add_request("a", ps[0], greedy(5))
        engine.add_request("b", ps[1], greedy(5))
        done, steps = [], 0
        while engine.has_unfinished_requests():
            done += [o for o in engine.step() if o.finished]
            steps += 1
            if steps in (1, 3):  # after the prefill, and between two decoding steps
                llm.collective_rpc("execute_dummy_batch")
    assert mon.dropped == 0
    compare(mon.summary(), hf_table(tiny_llama, processed_tokens(done), **OPTS))
    assert int(mon.summary()["n_tokens"].iloc[0]) == (14 + 4) + (10 + 4)
