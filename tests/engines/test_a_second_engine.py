"""A second serving engine is one registration (issue 57): ``eh.monitor``, ``eh.Monitor``, ``eh.spectra`` and
``eh.verify`` all consult ``models.engines``, so an engine defined in this one file, registered in one
line, gets its own monitor (here one that runs the model's forwards as flat batches through the
engine-neutral ``EngineRecord``), its checkpoint's spectra and verify's refusal; nothing else changes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers as T

import eigenhooks as eh
from eigenhooks.engines.requests import EngineRecord, TokenMap
from eigenhooks.engines.vllm.session import CheckpointAdapter
from eigenhooks.models import Adapter
from eigenhooks.models.engines import Engine, EngineVerifyError, engine_of, register, unregister

SETTINGS = {"null_draws": 8, "null_stride": 2}


class ToyEngine:
    """A serving engine in miniature: it owns an HF model and runs requests as one flat batch each step."""

    def __init__(self, model):
        self.model, self.runs = model, []

    def generate(self, requests: dict[str, list[int]]) -> None:
        for key, ids in requests.items():
            self.runs.append((key, ids))
            self.model(input_ids=torch.tensor([ids]))


class ToyMonitor:
    """The engine's monitor: hooks on the HF layers hand each run's readings to an ``EngineRecord``."""

    def __init__(self, engine: ToyEngine, **settings):
        mon = eh.Monitor(engine.model, attach=False, **settings)
        adapter = CheckpointAdapter(**{f.name: getattr(mon.adapter, f.name) for f in dataclasses.fields(Adapter)})
        record, self.att = mon.record_spec().attach(adapter)
        self.engine, self.sums, self.mon = engine, EngineRecord(record), mon

    def __enter__(self):
        self.seen = len(self.engine.runs)
        return self

    def __exit__(self, *exc):
        from tests.engines.test_requests import readings_of

        for key, ids in self.engine.runs[self.seen :]:
            self.sums.forward(readings_of(self.engine.model, ids), TokenMap([key], [len(ids)], [0]))
        self.sums.end([k for k, _ in self.engine.runs[self.seen :]])
        self.mon.load_state_dict(self.sums.state_dict())

    def summary(self):
        return self.mon.summary()


def _verify_error(engine):
    return EngineVerifyError("eh.verify cannot probe a ToyEngine; verify its .model")


TOY = Engine("toy", lambda o: isinstance(o, ToyEngine), ToyMonitor, lambda e: eh.get_adapter(e.model), _verify_error)


@pytest.fixture
def toy():
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)  # fmt: skip
    model = T.LlamaForCausalLM(cfg).eval()
    register(TOY)  # the one line
    yield ToyEngine(model)
    unregister("toy")


def test_a_second_engine_registered_in_one_line_is_monitored_and_read(toy):
    assert engine_of(toy).name == "toy" and engine_of(toy.model) is None
    seqs = {"a": list(range(3, 20)), "b": list(range(30, 41))}
    with torch.no_grad(), eh.monitor(toy, **SETTINGS) as mon:
        toy.generate(seqs)
    assert isinstance(mon, ToyMonitor) and isinstance(eh.Monitor(toy, **SETTINGS), ToyMonitor)
    with torch.no_grad(), eh.monitor(toy.model, **SETTINGS) as hf:
        for ids in seqs.values():
            toy.model(input_ids=torch.tensor([ids]))
    got, want = mon.summary(), hf.summary()
    assert list(got["n_tokens"]) == list(want["n_tokens"]) == [28] * len(want)
    for c in ("gamma_pre", "gamma_mid", "gamma_post", "rho", "n_sequences"):
        torch.testing.assert_close(torch.tensor(got[c].to_numpy()), torch.tensor(want[c].to_numpy()), rtol=1e-5, atol=0)
    specs, own = eh.spectra(toy, cache=False), eh.spectra(toy.model, cache=False)
    assert [s.lambda_1 for s in specs] == [s.lambda_1 for s in own]
    with pytest.raises(EngineVerifyError, match="cannot probe a ToyEngine"):
        eh.verify(toy)


def test_unregistered_it_is_no_engine(toy):
    unregister("toy")
    assert engine_of(toy) is None
    with pytest.raises(eh.UnsupportedModelError):
        eh.spectra(toy, cache=False)
