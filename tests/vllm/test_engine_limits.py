"""What an opted-in vLLM engine cannot measure is refused in one line, before anything loads."""

from __future__ import annotations

import pytest
from tier import start_engine

import eigenhooks as eh

OPT_IN = {"eigenhooks": {}}


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}},
         "does not measure speculative decoding"),
        ({"enable_lora": True}, "does not measure LoRA engines"),
        ({"pipeline_parallel_size": 2}, "does not measure pipeline parallel engines"),
        ({"worker_extension_cls": "mypkg.Ext"}, "needs the worker extension"),
        ({"additional_config": {"eigenhooks": {"outt": "x"}}}, r"unknown eigenhooks options \['outt'\]"),
    ],
)  # fmt: skip
def test_what_cannot_be_measured_is_refused_in_one_line(tiny_llama, kw, match):
    from eigenhooks.engines.vllm.plugin import EigenhooksConfigError

    with pytest.raises(EigenhooksConfigError, match=match) as e:
        start_engine(tiny_llama, **{"additional_config": OPT_IN, **kw})
    assert "\n" not in str(e.value)


def test_an_unknown_architecture_is_refused_naming_the_known_ones():
    folder = eh.zoo.path("gpt2-tiny")  # vLLM runs GPT-2; eigenhooks' vLLM taps do not know its layers
    with pytest.raises(eh.UnsupportedModelError, match=r"cannot monitor vLLM architecture \['GPT2LMHeadModel'\]"):
        start_engine(folder, additional_config=OPT_IN, max_model_len=32)


def test_without_the_key_the_plugin_changes_nothing(tiny_llama):
    from vllm.engine.arg_utils import EngineArgs

    from eigenhooks.engines.vllm.plugin import register

    register()  # vLLM ran it already in this process; again is a no-op
    args = EngineArgs(model=str(tiny_llama), dtype="float32", max_model_len=64)
    cfg = args.create_engine_config()
    assert cfg.parallel_config.worker_extension_cls == "" and "eigenhooks" not in (cfg.additional_config or {})
    opted = EngineArgs(model=str(tiny_llama), dtype="float32", max_model_len=64, additional_config=OPT_IN)
    cfg2 = opted.create_engine_config()
    assert cfg2.parallel_config.worker_extension_cls == "eigenhooks.engines.vllm.worker.EigenhooksWorker"
    assert cfg.compute_hash() != cfg2.compute_hash()  # the compile cache keys them apart


def test_the_taps_version_keys_the_compile_cache(tiny_llama, monkeypatch):
    """A graph compiled with another version's taps (another op signature) is never taken from the cache:
    the opt-in puts the taps' version in the config hash."""
    from vllm.engine.arg_utils import EngineArgs

    from eigenhooks.engines.vllm import plugin

    def config_hash():
        return EngineArgs(model=str(tiny_llama), dtype="float32", max_model_len=64,
                          additional_config=OPT_IN).create_engine_config().compute_hash()  # fmt: skip

    now = config_hash()
    assert config_hash() == now  # the hash is stable for one version
    monkeypatch.setattr(plugin, "TAPS", plugin.TAPS + 1)
    assert config_hash() != now
    assert OPT_IN == {"eigenhooks": {}}  # the user's dict is left as it was
