"""An engine's flat batches counted as sequences (eigenhooks/engines/requests.py), without an engine.

A causal model's reading of a token depends only on its own sequence's prefix, so slices of an HF
model's readings of whole sequences are what an engine's forward computes for those tokens, however
it batches them. Flat batches are built from such slices the way a serving engine runs them (chunked
prefill, requests concatenated, a preempted request recomputed from position 0, a cached prefix never
computed) and their table is checked against the HF monitor fed the whole sequences.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import transformers as T

import eigenhooks as eh
from eigenhooks.engines.requests import EngineRecord, Ledger, TokenMap
from eigenhooks.engines.vllm.session import CheckpointAdapter
from eigenhooks.models import Adapter

SETTINGS = {"null_draws": 8, "null_stride": 2}


def tiny_llama():
    """A seeded 2-layer GQA Llama, checked tiny."""
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)  # fmt: skip
    model = T.LlamaForCausalLM(cfg).eval()
    assert sum(p.numel() for p in model.parameters()) < 50_000
    return model


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def readings_of(model, ids: list[int]) -> dict[str, list[torch.Tensor]]:
    """pre, attn, post of every layer for one whole sequence, (n, d) each (hooks on the HF modules)."""
    out = {"pre": [], "attn": [], "post": []}
    hs = []
    for blk in model.model.layers:
        hs.append(blk.register_forward_pre_hook(lambda m, a, k: out["pre"].append((a[0] if a else k["hidden_states"])[0]),
                                                with_kwargs=True))  # fmt: skip
        hs.append(blk.self_attn.register_forward_hook(lambda m, a, o: out["attn"].append(o[0][0])))
        hs.append(
            blk.register_forward_hook(lambda m, a, o: out["post"].append((o[0] if isinstance(o, tuple) else o)[0]))
        )
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
    finally:
        for h in hs:
            h.remove()
    return out


def flat(chunks, reads):
    """One flat forward of (key, start, stop) chunks: readings concatenated, and its TokenMap."""
    r = {p: [torch.cat([reads[k][p][i][a:b] for k, a, b in chunks]) for i in range(2)] for p in reads["A"]}
    return r, TokenMap([k for k, _, _ in chunks], [b - a for _, a, b in chunks], [a for _, a, _ in chunks])


def engine_record(model) -> EngineRecord:
    """A record as an engine's worker makes it (``RecordSpec.attach``), told flat batches by ``EngineRecord``."""
    mon = eh.Monitor(model, attach=False, **SETTINGS)
    base = mon.adapter
    adapter = CheckpointAdapter(**{f.name: getattr(base, f.name) for f in dataclasses.fields(Adapter)})
    record, _ = mon.record_spec().attach(adapter)
    return EngineRecord(record)


def hf_table(model, seqs):
    with eh.monitor(model, **SETTINGS) as mon:
        for s in seqs:
            model(input_ids=torch.tensor([s]))
    return mon.summary()


COLS = ["n_tokens", "rho_null_tokens", "n_sequences", "gamma_pre", "gamma_mid", "gamma_post", "rho", "p_null",
        "rho_ci_lo", "rho_ci_hi"]  # fmt: skip


def assert_tables_equal(a, b):
    for c in COLS:
        np.testing.assert_allclose(b[c].to_numpy(float), a[c].to_numpy(float), rtol=1e-5, atol=1e-7, err_msg=c)


def test_flat_batches_equal_the_hf_monitor_on_whole_sequences(llama):
    g = torch.Generator().manual_seed(3)
    seqs = {
        "A": torch.randint(0, 64, (23,), generator=g).tolist(),
        "B": torch.randint(0, 64, (11,), generator=g).tolist(),
    }
    reads = {k: readings_of(llama, s) for k, s in seqs.items()}
    sums = engine_record(llama)
    schedule = [
        [("A", 0, 8), ("B", 0, 11)],  # chunked prefill of A beside B's whole prompt
        [("A", 8, 20)],
        [("B", 0, 11)],  # B preempted and recomputed from 0: nothing of it counts again
        [("A", 20, 21), ("B", 10, 11)],  # decode steps (B's last position again: not counted twice)
        [("A", 21, 23)],
    ]
    for chunks in schedule:
        sums.forward(*flat(chunks, reads))
    sums.end(["A", "B"])
    assert_tables_equal(hf_table(llama, list(seqs.values())), _table(llama, sums))
    rows = {r["request_id"]: r for r in sums.rows() if r["layer"] == 0 and r["target"] == "ov/modulus"}
    assert rows["A"]["n_tokens"] == 23 and rows["B"]["n_tokens"] == 11
    assert rows["B"]["recomputed"] == 12 and rows["A"]["recomputed"] == 0
    assert_rows_are_each_requests_own(sums, reads)


def assert_rows_are_each_requests_own(sums, reads):
    """Each request's rows equal numpy's alignments of that request's own readings, a(x) = ||U^T x|| / ||x||
    (each position once), and the requests' rows add up to the table's sums."""
    plan, got = sums.record.plan, sums.rows()
    assert len(got) == len(reads) * sum(len(plan.layers[i].meta) for i in plan.layers)
    row = {(r["request_id"], r["layer"], r["target"]): r for r in got}
    state = sums.state_dict()["layers"]
    for i, lp in plan.layers.items():
        for ti, meta in enumerate(lp.meta):
            U = lp.targets[ti].U.double().numpy()
            total = {"pre": 0.0, "mid": 0.0, "post": 0.0}
            for key, rd in reads.items():
                X = {p: rd[p][i].double().numpy() for p in ("pre", "attn", "post")}
                X["mid"] = X["pre"] + X["attn"]
                a = {p: np.linalg.norm(X[p] @ U, axis=1) / np.linalg.norm(X[p], axis=1) for p in total}
                r, n = row[(key, i, meta.name)], len(X["pre"])
                assert r["n_tokens"] == n
                for p in total:
                    assert r[f"gamma_{p}"] == pytest.approx(a[p].mean(), rel=1e-5), (key, i, p)
                    total[p] += r[f"gamma_{p}"] * n
                assert abs(r["rho"] - float(np.mean(a["mid"] - a["pre"] > 1e-6))) <= 1 / n + 1e-12
            sums_t = dict(zip(eh.monitor.measures.TGT_FIELDS, state[str(i)]["tgt"][ti]))
            for p in total:
                assert total[p] == pytest.approx(sums_t[f"sum_{p}"], rel=1e-6), (i, p)


def _table(model, sums):
    mon = eh.Monitor(model, attach=False, **SETTINGS)
    mon.load_state_dict(sums.state_dict())
    return mon.summary()


def test_a_request_run_beside_others_equals_it_run_alone(llama):
    g = torch.Generator().manual_seed(4)
    seqs = {k: torch.randint(0, 64, (n,), generator=g).tolist() for k, n in (("A", 15), ("B", 9))}
    reads = {k: readings_of(llama, s) for k, s in seqs.items()}
    both = engine_record(llama)
    both.forward(*flat([("A", 0, 15), ("B", 0, 9)], reads))
    alone = engine_record(llama)
    for a, b in ((0, 6), (6, 15)):
        alone.forward(*flat([("A", a, b)], reads))
    key = lambda r: (r["request_id"], r["layer"], r["target"])  # noqa: E731
    got = {key(r): r for r in both.rows() if r["request_id"] == "A"}
    want = {key(r): r for r in alone.rows()}
    assert got.keys() == want.keys() and len(got) == 4
    for k in got:
        for c in ("n_tokens", "gamma_pre", "gamma_mid", "gamma_post", "rho"):
            assert got[k][c] == pytest.approx(want[k][c], rel=1e-4), (k, c)
    # one request's rows are the table of that request alone
    table = _table(llama, alone)
    for _, t in table.iterrows():
        for c in ("gamma_pre", "gamma_mid", "gamma_post", "rho"):
            assert want[("A", t["layer"], t["target"])][c] == pytest.approx(t[c], rel=1e-5), c


def test_the_ledger_counts_each_position_once_and_says_the_cached_prefix():
    led = Ledger()
    assert led.admit(TokenMap(["a", "b"], [5, 3], [0, 128])) == [0, 0]  # b: 128 positions from the cache
    assert led.admit(TokenMap(["a"], [7], [0])) == [5]  # a recomputed after a preemption
    assert led.info["a"].counted == 7 and led.info["a"].recomputed == 5
    assert led.info["b"].first == 128 and led.info["b"].counted == 3
    assert led.end("a").upto == 7 and "a" not in led.info


def test_decoding_steps_told_together_equal_them_told_one_by_one(llama, monkeypatch):
    """An engine's decoding steps are staged and told as one flat batch (``Steps``): the table, the
    consensus columns (one forward's, never across steps) and each request's rows equal them told one by
    one, and the HF monitor's on the whole sequences."""
    from eigenhooks.engines import requests

    g = torch.Generator().manual_seed(5)
    seqs = {k: torch.randint(0, 64, (n,), generator=g).tolist() for k, n in (("A", 30), ("B", 18), ("C", 16))}
    reads = {k: readings_of(llama, s) for k, s in seqs.items()}
    schedule = [[("A", 0, 10), ("B", 0, 10)]]
    schedule += [[("A", t, t + 1), ("B", t, t + 1)] for t in range(10, 18)]  # B ends after its 18th
    schedule += [[("A", 18, 19), ("C", 0, 8)]]  # C's prompt beside A's step
    schedule += [[("A", t, t + 1), ("C", t - 11, t - 10)] for t in range(19, 27)]
    schedule += [[("A", t, t + 1)] for t in range(27, 30)]

    def run(step_tokens):
        monkeypatch.setattr(requests, "STEP_TOKENS", step_tokens)
        sums, told = engine_record(llama), []
        start = sums.record.forward_start
        monkeypatch.setattr(sums.record, "forward_start", lambda facts: (told.append(facts.flat.steps), start(facts)))
        for chunks in schedule:
            readings, tm = flat(chunks, reads)
            sums.forward(readings, tm)
            for xs in readings.values():  # the engine's next forward writes over its buffers: what is staged
                for x in xs:  # must be a copy
                    x.fill_(float("nan"))
            if chunks[-1] == ("B", 17, 18):
                sums.end(["B"])
        sums.end(["A", "C"])
        return sums, told

    together, told_together = run(256)
    apart, told_apart = run(1)
    assert told_apart == [1] * len(schedule) and max(told_together) == 8 and len(told_together) == 5
    a, b = _table(llama, apart), _table(llama, together)
    cons = [c for c in a.columns if c.startswith("consensus_")]
    assert cons and a[cons].notna().all().all()
    for c in COLS + cons:
        np.testing.assert_allclose(b[c].to_numpy(float), a[c].to_numpy(float), rtol=1e-6, atol=1e-9, err_msg=c)
    assert_tables_equal(hf_table(llama, list(seqs.values())), b)
    key = lambda r: (r["request_id"], r["layer"], r["target"])  # noqa: E731
    ra, rb = {key(r): r for r in apart.rows()}, {key(r): r for r in together.rows()}
    assert ra.keys() == rb.keys() and len(ra) == 12
    for k in ra:
        for c in ("n_tokens", "gamma_pre", "gamma_mid", "gamma_post", "rho"):
            assert rb[k][c] == pytest.approx(ra[k][c], rel=1e-5), (k, c)


def test_log_points_count_engine_forwards_and_hold_the_values_then(llama):
    """A log point every 3 engine forwards, staged decoding steps told first: each point's values are the
    sinks' values (``Monitor.scalars``) of the forwards up to it, its step their count."""
    g = torch.Generator().manual_seed(6)
    seqs = {k: torch.randint(0, 64, (n,), generator=g).tolist() for k, n in (("A", 14), ("B", 12))}
    reads = {k: readings_of(llama, s) for k, s in seqs.items()}
    schedule = [[("A", 0, 6), ("B", 0, 4)]] + [[("A", t, t + 1), ("B", t - 2, t - 1)] for t in range(6, 14)]
    logged = engine_record(llama)
    logged.log_every = 3
    for chunks in schedule:
        logged.forward(*flat(chunks, reads))
    points = logged.take_log_points()
    assert [s for s, _ in points] == [3, 6, 9] and logged.take_log_points() == []
    for step, values in points:
        upto = engine_record(llama)
        for chunks in schedule[:step]:
            upto.forward(*flat(chunks, reads))
        mon = eh.Monitor(llama, attach=False, **SETTINGS)
        mon.load_state_dict(upto.state_dict())
        want = mon.scalars()
        assert values.keys() == want.keys() and len(values) > 10
        for k in want:
            assert values[k] == pytest.approx(want[k], rel=1e-6, abs=1e-12, nan_ok=True), (step, k)  # float32 sums


def test_a_layout_the_engine_knows_changes_nothing(llama, monkeypatch):
    """Full row-major chunks (``layout="rows"``) and staged steps (``"steps"``) are read as views of the
    padded batch, not scattered into one: the state is bit for bit the one the scatter gives."""
    from eigenhooks.engines import requests
    from eigenhooks.models.attach import FlatRows

    g = torch.Generator().manual_seed(6)
    seqs = {k: torch.randint(0, 64, (n,), generator=g).tolist() for k in ("A", "B") for n in (20,)}
    reads = {k: readings_of(llama, s) for k, s in seqs.items()}
    schedule = [[("A", 0, 8), ("B", 0, 8)], [("A", 8, 12), ("B", 8, 10)]]  # rows, then unequal chunks
    schedule += [[("A", t, t + 1), ("B", t - 2, t - 1)] for t in range(12, 20)]  # steps: staged

    def run(hint: bool):
        layouts = []

        def made(*args, **kw):
            f = FlatRows(*args, **kw)
            layouts.append(f.layout)
            return f if hint else f._replace(layout="")

        monkeypatch.setattr(requests, "FlatRows", made)
        sums = engine_record(llama)
        for chunks in schedule:
            sums.forward(*flat(chunks, reads))
        sums.end(["A", "B"])
        return sums.state_dict(), layouts

    (hinted, layouts), (scattered, _) = run(True), run(False)
    assert layouts == ["rows", "", "steps"]
    assert hinted == scattered
