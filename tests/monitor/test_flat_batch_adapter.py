"""A second engine plugs into the monitor through the adapter interface alone (docs/adapters.md), with no
branch in eigenhooks/monitor/: a fake flat-batch engine (``flat_engine``) whose batches are flat and ragged,
whose requests last across forwards until its scheduler ends them, whose record may live in a worker
process, and whose readings may come out of a compiled graph. Checked against the model run as an
HF-style padded batch under the monitor's own hooks."""

import multiprocessing as mp

import pandas as pd
import pytest
import torch

import eigenhooks as eh
from eigenhooks.monitor.measures import TGT_FIELDS
from eigenhooks.monitor.verdict import SAMPLE_COLUMNS

from .flat_engine import FlatEngine, padded, tiny_llama, worker

KW = dict(targets=[("ov", "modulus"), ("ov", "residual")], null_draws=8, fnull_draws=4, eig_top=3, null_stride=3)
SEQS = {"a": [5, 9, 13, 2, 7], "b": [3, 11, 4], "c": [8, 1, 6, 12, 10, 9, 14]}  # ragged


def _padded_run(model):
    ids, mask = padded(SEQS)
    with eh.monitor(model, **KW) as mon, torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    return mon


def _flat_run(engine, steps, **kw):
    with eh.monitor(engine.adapter, **{**KW, **kw}) as mon:
        engine.prefill(SEQS)
        for step in steps:
            if step[0] == "end":
                engine.finish(step[1])
            else:
                engine.forward(step)
    return mon


# consensus is taken over a sequence's tokens in one forward (docs/design.md): a chunked request has its chunks'
PER_FORWARD = [j for j, f in enumerate(TGT_FIELDS) if f.startswith("cons_sum") or f == "n_seq"]


def _same_states(a: dict, b: dict, exact: bool) -> None:
    assert a.keys() == b.keys()
    for layer in a:
        for k in a[layer]:
            x, y = torch.tensor(a[layer][k], dtype=torch.float64), torch.tensor(b[layer][k], dtype=torch.float64)
            if not exact and k == "tgt":
                x[:, PER_FORWARD] = y[:, PER_FORWARD] = 0
            # sums accumulate in float32 on the device per forward: other forwards, other roundings
            tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-6, "atol": 1e-6}
            torch.testing.assert_close(x, y, equal_nan=True, msg=f"layer {layer} field {k}", **tol)


def _per_request(df):
    """The columns a flat batch shares with the padded run of its requests: not consensus (a within-forward
    statistic), and not the verdict's, whose kept tokens are chosen by each sequence's first forward (under a
    chunked prefill, a request's first chunk: docs/concepts.md, "The verdict's tokens")."""
    return df[[c for c in df.columns if not c.startswith("consensus") and c not in SAMPLE_COLUMNS]]


ONE_FORWARD = [[(k, 0, len(s)) for k, s in SEQS.items()], ("end", list(SEQS))]
# a chunked prefill: requests across three forwards, in another order each time; b ends before c's last chunk
CHUNKED = [
    [("a", 0, 3), ("b", 0, 2)],
    [("c", 0, 4), ("b", 2, 3), ("a", 3, 5)],
    ("end", ["b"]),
    [("c", 4, 7)],
    ("end", ["a", "c"]),
]


def test_a_flat_ragged_batch_counts_as_the_padded_batch_bit_for_bit():
    model = tiny_llama()
    hf = _padded_run(model)
    flat = _flat_run(FlatEngine(model), ONE_FORWARD)
    _same_states(hf.state_dict()["layers"], flat.state_dict()["layers"], exact=True)
    pd.testing.assert_frame_equal(hf.summary(), flat.summary(), check_exact=True)
    assert flat.summary()["n_tokens"].tolist() == [15] * 4


def test_a_request_s_tokens_may_come_interleaved_with_others():
    """Tokens in turns (a0 b0 c0 a1 b1 c1 ...), not request by request: each keeps its request and position."""
    model = tiny_llama()
    hf = _padded_run(model)
    engine = FlatEngine(model)
    with eh.monitor(engine.adapter, **KW) as mon:
        engine.prefill(SEQS)
        engine.forward(ONE_FORWARD[0], interleave=True)
        engine.finish(list(SEQS))
    _same_states(hf.state_dict()["layers"], mon.state_dict()["layers"], exact=True)


def test_a_flat_forward_with_its_width_reads_nothing_back():
    from .test_no_host_sync import _check, trapped

    engine = FlatEngine(tiny_llama())
    with eh.monitor(engine.adapter, **KW):
        engine.prefill(SEQS)
        with trapped() as trap:
            engine.forward(CHUNKED[0], width=True)
            engine.forward(CHUNKED[1], width=True)
    # the requests' slots (the accumulator's, by key, on the host) go to the device once a forward
    slots = [w for w in trap.seen if w[0] == "aten::lift_fresh" and w[1].startswith("monitor/accumulate.py")]
    assert len(slots) == 2
    trap.seen = [w for w in trap.seen if w not in slots]
    _check(trap)


def test_requests_last_across_forwards_until_the_scheduler_ends_them():
    model = tiny_llama()
    hf = _padded_run(model)
    engine = FlatEngine(model)
    with eh.monitor(engine.adapter, **KW) as mon:
        engine.prefill(SEQS)
        engine.forward(CHUNKED[0])
        engine.forward(CHUNKED[1])
        acc = mon._acc
        assert set(acc.keyed) == {"a", "b", "c"}  # a forward's end ends no request
        engine.finish(["b"])
        assert set(acc.keyed) == {"a", "c"}
        engine.forward(CHUNKED[3])
        engine.finish(["a", "c"])
        assert not acc.keyed
    # one cluster a request (three), not one a request's chunk (six): the same sums as the padded batch
    _same_states(hf.state_dict()["layers"], mon.state_dict()["layers"], exact=False)
    pd.testing.assert_frame_equal(_per_request(hf.summary()), _per_request(mon.summary()), rtol=1e-5)


def test_a_request_ended_after_each_forward_is_another_count():
    """The check above can fail: ending each request at each forward's end splits it into clusters."""
    model = tiny_llama()
    hf = _padded_run(model)
    split = [CHUNKED[0], ("end", ["a", "b"]), CHUNKED[1], ("end", ["a", "b", "c"]), CHUNKED[3], ("end", ["c"])]
    mon = _flat_run(FlatEngine(model), split)
    a, b = hf.state_dict()["layers"], mon.state_dict()["layers"]
    assert a["0"]["tgt"] != b["0"]["tgt"]
    assert hf.summary()["n_tokens"].tolist() == mon.summary()["n_tokens"].tolist()


def test_the_record_lives_in_a_worker_process_and_is_read_back():
    model = tiny_llama()
    here = _flat_run(FlatEngine(model), CHUNKED)
    mon = eh.Monitor(FlatEngine(model).adapter, **KW)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=worker, args=(mon.record_spec(), SEQS, CHUNKED, out))
    p.start()
    state = out.get(timeout=300)
    p.join(60)
    assert p.exitcode == 0
    mon.merge_state_dict(state)
    _same_states(here.state_dict()["layers"], mon.state_dict()["layers"], exact=True)
    pd.testing.assert_frame_equal(here.summary(), mon.summary(), check_exact=True)


def test_readings_taken_inside_a_compiled_graph():
    """torch.compile(fullgraph=True): the engine's hooks are traced into the graph, which writes each reading
    into its buffer; no Python runs per reading, and the forward's readings reach the record after it."""
    pytest.importorskip("torch._inductor")
    model = tiny_llama()
    eager_engine = FlatEngine(model)
    eager = _flat_run(eager_engine, CHUNKED)
    assert eager_engine.python_reads > 0
    torch._dynamo.reset()
    engine = FlatEngine(model, compiled=True)
    compiled = _flat_run(engine, CHUNKED)
    assert engine.python_reads == 0, "a hook ran as Python outside the compiled graph"
    _same_states(eager.state_dict()["layers"], compiled.state_dict()["layers"], exact=False)
    pd.testing.assert_frame_equal(eager.summary(), compiled.summary(), rtol=1e-5)
    assert compiled.summary()["n_tokens"].tolist() == [15] * 4
