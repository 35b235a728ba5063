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


@pytest.mark.parametrize(
    "opts, match",
    [
        ({"out": "{file}/sub"}, r"eigenhooks option 'out': cannot make the folder '.*/a-file/sub'"),
        ({"out": 7}, r"eigenhooks option 'out' must be a folder path, got 7"),
        ({"settings": {"null_draws": -5}}, r"option 'settings': null_draws must be a positive int, got -5"),
        ({"settings": {"nul_draws": 9}}, r"option 'settings': .*unexpected or repeated settings \['nul_draws'\]"),
        ({"settings": {"reading_points": ["mid"]}}, r"option 'settings': reading_points must include 'pre'"),
        ({"settings": 3}, r"option 'settings' must be a dict of eh.monitor's settings, got 3"),
    ],
)  # fmt: skip
def test_bad_options_are_refused_where_the_engine_is_built(tiny_llama, tmp_path, opts, match):
    """Checked in the process that builds the engine, before any model loads (the served ``out`` and
    ``settings`` used to fail in the worker after the model loaded), in one line naming the option."""
    from eigenhooks.engines.vllm.plugin import EigenhooksConfigError

    (tmp_path / "a-file").write_text("")
    if isinstance(opts.get("out"), str):
        opts = {**opts, "out": opts["out"].format(file=tmp_path / "a-file")}
    with pytest.raises(EigenhooksConfigError, match=match) as e:
        start_engine(tiny_llama, additional_config={"eigenhooks": opts})
    assert "\n" not in str(e.value)


def test_a_good_out_folder_is_made_when_the_engine_is_built(tiny_llama, tmp_path):
    from vllm.engine.arg_utils import EngineArgs

    out = tmp_path / "new" / "eh"
    extra = {"eigenhooks": {"out": str(out), "settings": {"null_draws": 9, "targets": [["ov", "modulus"]]}}}
    EngineArgs(model=str(tiny_llama), dtype="float32", max_model_len=64, additional_config=extra).create_engine_config()
    assert out.is_dir()


def test_with_request_id_randomisation_off_the_build_warns_once(tiny_llama, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")
    with pytest.warns(UserWarning, match="requests that share an id are one request") as got:
        for _ in range(2):
            EngineArgs(model=str(tiny_llama), dtype="float32", max_model_len=64,
                       additional_config=OPT_IN).create_engine_config()  # fmt: skip
    assert sum("share an id" in str(w.message) for w in got) == 1


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


def test_eh_monitor_on_an_engine_it_cannot_read_says_so_not_opt_in(tmp_path):
    """A plain engine of an architecture whose layers eigenhooks cannot read: eh.monitor names it in one
    line (opting in would be refused at the build), not "build it with additional_config"."""
    import torch
    import transformers as T

    torch.manual_seed(0)
    cfg = T.GPT2Config(vocab_size=1024, n_embd=128, n_layer=1, n_head=4, n_positions=64)  # head_dim 32
    T.GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((eh.zoo.path("gpt2-tiny") / f).read_bytes())
    llm = start_engine(tmp_path, enforce_eager=True, max_model_len=32)
    try:
        with pytest.raises(
            eh.UnsupportedModelError, match=r"cannot monitor vLLM architecture \['GPT2LMHeadModel'\]"
        ) as e:
            eh.monitor(llm)
        assert "\n" not in str(e.value) and "additional_config" not in str(e.value)
    finally:
        llm.llm_engine.engine_core.shutdown()
