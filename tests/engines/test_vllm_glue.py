"""The vLLM glue's engine-free parts: request ids as the user sees them, the served jsonl lines."""

from __future__ import annotations

import json
import os

import pytest

from eigenhooks.engines.requests import EngineRecord
from eigenhooks.engines.vllm.ids import api_label, request_label, split_sample, user_key
from eigenhooks.engines.vllm.serve import JsonlSink, read_lines


def test_internal_request_ids_map_to_the_users():
    assert user_key("7-1a2b3c4d", randomized=True) == "7"
    assert user_key("cmpl-abc-0-1a2b3c4d", randomized=True) == "cmpl-abc-0"
    assert user_key("2_req-1a2b3c4d", randomized=True) == "2_req"  # sample 2 of an n > 1 request
    assert user_key("my-id", randomized=False) == "my-id"
    key = "cmpl-abc-3-0f9e8d7c"
    assert api_label(key) == {"request_id": "cmpl-abc", "sample": 0, "prompt_index": 3, "engine_id": key}
    key = "chatcmpl-xyz-12345678"
    assert api_label(key) == {"request_id": "chatcmpl-xyz", "sample": 0, "engine_id": key}
    key = "1_cmpl-abc-3-aaaabbbb"  # n > 1
    assert api_label(key) == {"request_id": "cmpl-abc", "sample": 1, "prompt_index": 3, "engine_id": key}
    # two requests the user gave one id: one request_id, two keys
    a, b = request_label("trace-42-0a1b2c3d"), request_label("trace-42-9f8e7d6c")
    assert a["request_id"] == b["request_id"] == "trace-42" and a["engine_id"] != b["engine_id"]
    assert split_sample("2_7") == ("7", 2) and split_sample("7") == ("7", 0)
    assert split_sample("cmpl-1_2") == ("cmpl-1_2", 0)


def test_the_served_sink_writes_whole_lines_and_forgets_what_it_wrote(tmp_path):
    import torch
    import transformers as T

    from tests.engines.test_requests import engine_record, flat, readings_of

    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)  # fmt: skip
    model = T.LlamaForCausalLM(cfg).eval()
    reads = {"A": readings_of(model, list(range(9))), "B": readings_of(model, list(range(5, 20)))}
    eng: EngineRecord = engine_record(model)
    sink = JsonlSink(tmp_path)
    eng.forward(*flat([("A", 0, 9), ("B", 0, 15)], reads))
    eng.end(["A"])
    sink.write_ended(eng)
    assert eng.own.done == [] and "A" not in eng.record.request_counters()  # written, then forgotten: bounded
    with open(sink.path, "ab") as f:
        f.write(b'{"request_id": "cut by a ki')  # a line a kill cut short
    lines = read_lines(tmp_path)
    assert [line["request_id"] for line in lines] == ["A"]
    assert {r["n_tokens"] for r in lines[0]["layers"]} == {9} and len(lines[0]["layers"]) == 4
    assert sink.path.name == f"eigenhooks-{os.uname().nodename}-{os.getpid()}.jsonl"
    json.dumps(lines)
    sink.close()
    with pytest.raises(OSError):
        os.fstat(sink.fd)


def test_requests_on_an_hf_model_says_in_one_line_that_it_cannot():
    import eigenhooks as eh

    model, _ = eh.zoo.load("gpt2-tiny")
    with pytest.raises(TypeError, match=r"one row per request of a serving engine") as e:
        eh.Monitor(model).requests()
    assert "\n" not in str(e.value)


def test_a_forward_is_keyed_by_internal_ids_and_placed_from_host_metadata():
    """The worker's map of a forward: each request by vLLM's internal id (two requests the user gave one id
    stay two), its first position from the runner's host-side ``num_computed_tokens_cpu`` (never a copy of
    the device's positions, which would wait for the forward)."""
    from types import SimpleNamespace

    import numpy as np

    from eigenhooks.engines.vllm.worker import _token_map

    class DeviceOnly:
        def __getitem__(self, _):
            raise AssertionError("the token map read the device's positions")

    ids = ["trace-42-0a1b2c3d", "trace-42-9f8e7d6c", "1_cmpl-x-0-aaaabbbb", "stale"]
    batch = SimpleNamespace(num_reqs=3, req_ids=ids, num_computed_tokens_cpu=np.array([0, 128, 7, 99], np.int32))
    sched = SimpleNamespace(num_scheduled_tokens={ids[0]: 5, ids[1]: 3, ids[2]: 1})
    tm = _token_map(SimpleNamespace(input_batch=batch, positions=DeviceOnly()), sched)
    assert tm.keys == ids[:3] and tm.counts == [5, 3, 1] and tm.starts == [0, 128, 7]
    assert all(type(s) is int for s in tm.starts)
    assert [request_label(k)["request_id"] for k in tm.keys] == ["trace-42", "trace-42", "cmpl-x-0"]
