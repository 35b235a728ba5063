"""The vLLM engine's monitor prints short (issue 50), engine-free: a stand-in ``llm`` carries the engine's
config, and the state it reads back is an HF monitor's of the same checkpoint, as ``eigenhooks_stop``
returns it. The line says the engine, the layers and targets, the engine's forwards and the tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers as T

import eigenhooks as eh
from eigenhooks.engines.vllm import monitor as engine


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)  # fmt: skip
    return T.LlamaForCausalLM(cfg).eval()


def _llm(model, answers: dict, calls: list):
    """A stand-in ``vllm.LLM``: its engine's config, and ``collective_rpc`` answering from ``answers``
    (rank 0's result, rank 1's None) and recording each call."""
    mc = SimpleNamespace(hf_config=model.config, architectures=["LlamaForCausalLM"])
    vc = SimpleNamespace(model_config=mc, additional_config={"eigenhooks": {}})

    def rpc(name, args=()):
        calls.append(name)
        return [answers.get(name), None]

    return SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=vc), collective_rpc=rpc)


def test_the_engine_monitor_prints_a_line_saying_the_engine(llama, monkeypatch):
    monkeypatch.setattr(
        engine, "make_monitor", lambda cfg, wire, sink=None, llm=None: eh.Monitor(llama, attach=False, **wire)
    )
    answers, calls = {"eigenhooks_start": True}, []
    mon = engine.EngineMonitor(_llm(llama, answers, calls), targets=[("ov", "modulus"), ("ov_head", "modulus")])
    text = repr(mon)
    assert text == "EngineMonitor(vLLM LlamaForCausalLM, 2 layers × 3 targets [ov/modulus, ov_head/modulus (2 heads)], " \
        "0 forwards, 0 tokens, not entered)", text  # fmt: skip
    with eh.monitor(llama, targets=[("ov", "modulus"), ("ov_head", "modulus")]) as hf:
        llama(torch.arange(1, 12)[None])
    answers["eigenhooks_read"] = answers["eigenhooks_stop"] = {
        "state": hf.state_dict(),
        "requests": [],
        "n_forwards": 3,
        "dropped": 0,
    }  # what the worker returns after 3 forwards of these 11 tokens
    mon.__enter__()
    assert "0 forwards, tokens in the engine (read() reads them), active)" in repr(mon)
    mon.read()
    assert repr(mon).endswith("3 forwards, 11 tokens, active, counts of the last read())"), repr(mon)
    n_calls = len(calls)
    repr(mon), mon._repr_html_()
    assert len(calls) == n_calls, "printing called into the engine"
    mon.__exit__(None, None, None)
    text = repr(mon)
    assert text.startswith("EngineMonitor(vLLM LlamaForCausalLM, 2 layers × 3 targets") and text.endswith("closed)")
    assert len(text.splitlines()) == 1 and len(text) <= 200
    page = mon._repr_html_()
    assert page.count("<table") == 1 and "vLLM LlamaForCausalLM" in page and "11 tokens" in page
