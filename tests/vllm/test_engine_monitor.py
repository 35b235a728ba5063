"""``eh.monitor`` on a running ``vllm.LLM``: the opt-in, the taps in eager and compiled mode, the request map.

Each table is checked against the HF monitor fed the tokens the engine's forwards processed (the parity
harness, tests/vllm/parity.py), float32. Engines run in vLLM's default separate process.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pandas as pd
import pytest
import torch
from parity import compare, hf_table, processed_tokens
from tier import start_engine

import eigenhooks as eh

OPTS = dict(null_draws=19, null_seed=0, null_stride=2)
OPT_IN = {"eigenhooks": {}}


def greedy(n: int):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def prompts(lengths, seed=1):
    from vllm.inputs import TokensPrompt

    g = torch.Generator().manual_seed(seed)
    return [TokensPrompt(prompt_token_ids=torch.randint(1, 1024, (n,), generator=g).tolist()) for n in lengths]


def shut(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def llm_opted_eager(tiny_llama):
    llm = start_engine(tiny_llama, enforce_eager=True, additional_config=OPT_IN)
    yield llm
    shut(llm)


def test_eager_engine_table_equals_hf_and_requests_are_rows(llm_opted_eager, tiny_llama):
    with eh.monitor(llm_opted_eager, **OPTS) as mon:
        outs = llm_opted_eager.generate(prompts([37, 12, 60, 25]), greedy(9))
    seqs = processed_tokens(outs)
    want = hf_table(tiny_llama, seqs, **OPTS)
    got = mon.summary()
    compare(got, want)
    assert int(got["n_tokens"].iloc[0]) == sum(len(s.token_ids) for s in seqs) == 4 * 8 + 134
    req = mon.requests()
    assert sorted(set(req["request_id"])) == sorted(o.request_id for o in outs)
    assert len(req) == 4 * len(got)  # one row per (request, layer, target)
    by = req[(req.layer == 0) & (req.target == "ov/modulus")].set_index("request_id")
    for s in seqs:
        assert by.loc[s.request_id, "n_tokens"] == len(s.token_ids)


def test_the_verdicts_sample_stays_in_the_worker_and_the_table_is_the_whole_states(llm_opted_eager, tiny_llama):
    """The state read back carries no verdict sample: its columns are computed in the worker, where the sample
    is, and equal those of the whole state (``state_dict()``: the sample crosses then) read in this process;
    the worker lets the sample go when the monitor goes."""
    from parity import hf_model

    from eigenhooks.monitor.accumulate import RemoteSample
    from eigenhooks.monitor.verdict import SAMPLE_COLUMNS

    opts = dict(OPTS, verdict_draws=99, verdict_tokens=128)
    with eh.monitor(llm_opted_eager, **opts) as mon:
        llm_opted_eager.generate(prompts([9 + i % 7 for i in range(24)], seed=7), greedy(4))
    assert isinstance(mon._mon._acc.sample, RemoteSample)  # your process holds none of the kept tokens
    got = mon.summary()
    assert got["p_tilt"].notna().all() and (got["verdict_sequences"] >= 10).all()
    here = eh.Monitor(hf_model(tiny_llama), attach=False, **opts)
    here.load_state_dict(mon.state_dict())
    want = here.summary()
    cols = [*SAMPLE_COLUMNS, "detectable_tilt"]
    pd.testing.assert_frame_equal(got[cols], want[cols])
    sid = mon._sid
    del mon
    gc.collect()
    with eh.monitor(llm_opted_eager, **opts):  # the next call into the engine lets go of the gone monitor's
        pass
    assert llm_opted_eager.collective_rpc("eigenhooks_release", args=([sid],)) == [0]  # let go already


def test_a_request_beside_others_equals_it_alone(llm_opted_eager):
    ps = prompts([41, 19, 77], seed=5)
    with eh.monitor(llm_opted_eager, **OPTS) as together:
        outs = llm_opted_eager.generate(ps, greedy(6))
    with eh.monitor(llm_opted_eager, **OPTS) as alone:
        solo = llm_opted_eager.generate(ps[:1], greedy(6))
    assert list(solo[0].outputs[0].token_ids) == list(outs[0].outputs[0].token_ids)
    a = together.requests().set_index(["request_id", "layer", "target"]).loc[outs[0].request_id]
    b = alone.requests().set_index(["request_id", "layer", "target"]).loc[solo[0].request_id]
    assert len(a) == len(b) == 4
    for c in ("gamma_pre", "gamma_mid", "gamma_post", "rho"):
        torch.testing.assert_close(torch.tensor(a[c].to_numpy()), torch.tensor(b[c].to_numpy()), rtol=1e-4, atol=0)
    assert (a["n_tokens"] == b["n_tokens"]).all()


def test_samples_of_n_above_one_are_rows_of_their_request(llm_opted_eager):
    """With n > 1 vLLM runs each sample as a request of its own: requests() gives each back under the id the
    user sees, with its CompletionOutput.index, counting the tokens that sample's forwards processed."""
    from vllm import SamplingParams

    sp = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True)
    with eh.monitor(llm_opted_eager, **OPTS) as mon:
        outs = llm_opted_eager.generate(prompts([21, 33], seed=9), sp)
    req = mon.requests()
    got = req[(req.layer == 0) & (req.target == "ov/modulus")]
    want = {(o.request_id, c.index): len(o.prompt_token_ids) + len(c.token_ids) - 1 for o in outs for c in o.outputs}
    assert len(want) == 4
    assert {(r.request_id, r.sample): r.n_tokens for r in got.itertuples()} == want
    assert int(mon.summary()["n_tokens"].iloc[0]) == sum(want.values())


def test_a_plain_engine_says_how_to_opt_in(llm_eager):
    with pytest.raises(RuntimeError, match=r"built without eigenhooks.*additional_config=\{'eigenhooks': \{\}\}"):
        eh.monitor(llm_eager)
    out = llm_eager.generate(prompts([9]), greedy(3))  # the plain engine runs as if eigenhooks were absent
    assert len(out[0].outputs[0].token_ids) == 3


def _graphs(root: Path) -> dict[str, bool]:
    """Each compiled graph in vLLM's cache: its key (directory) -> whether eigenhooks' tap is in its code."""
    out = {}
    for d in (root / "torch_compile_cache" / "torch_aot_compile").iterdir():
        code = [p.read_text(errors="ignore") for p in d.rglob("*.py")]
        out[d.name] = any("eigenhooks.vllm_tap" in c for c in code)
    return out


def test_compiled_engine_after_a_plain_one_in_one_cache(tiny_llama, tmp_path, monkeypatch):
    """A plain compiled engine first, then an opted-in one, in one compile cache: the second gets a graph of
    its own (with the taps), and its table equals HF's."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    plain = start_engine(tiny_llama)
    ref = plain.generate(prompts([30, 50]), greedy(5))
    shut(plain)
    assert list(_graphs(tmp_path).values()) == [False]
    llm = start_engine(tiny_llama, additional_config=OPT_IN)
    try:
        assert llm.llm_engine.vllm_config.compilation_config.mode != 0  # compiled, not eager
        with eh.monitor(llm, **OPTS) as mon:
            outs = llm.generate(prompts([30, 50]), greedy(5))
    finally:
        shut(llm)
    assert sorted(_graphs(tmp_path).values()) == [False, True]  # two keys: the plain graph and the tapped one
    assert [list(o.outputs[0].token_ids) for o in outs] == [list(o.outputs[0].token_ids) for o in ref]
    compare(mon.summary(), hf_table(tiny_llama, processed_tokens(outs), **OPTS))


def test_a_sink_logs_every_log_every_engine_forwards(llm_opted_eager):
    """A callable sink gets a log point every 4 engine forwards (step: the forwards counted), in order, and
    at the block's end the values of the whole block: those of its table."""
    got = []
    with eh.monitor(llm_opted_eager, **OPTS, sink=lambda step, values: got.append((step, values)), log_every=4) as mon:
        llm_opted_eager.generate(prompts([30, 18, 41]), greedy(10))
    steps = [s for s, _ in got]
    assert mon.n_forwards >= 10 and steps[:-1] == list(range(4, mon.n_forwards + 1, 4))
    assert steps[-1] == mon.n_forwards and len(set(steps)) == len(steps)
    n = "eigenhooks/n_tokens/L00/ov-modulus"
    counts = [v[n] for _, v in got]
    assert counts == sorted(counts) and counts[0] < counts[-1] == int(mon.summary()["n_tokens"].iloc[0])
    assert got[-1][1] == pytest.approx(mon.scalars(), nan_ok=True)
