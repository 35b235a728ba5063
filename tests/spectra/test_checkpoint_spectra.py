"""Spectra read from a checkpoint folder (what ``eh.spectra(llm)`` reads for a vLLM engine) against
``eh.spectra`` of the same checkpoint loaded in transformers, for every architecture the vLLM table
knows; and the one-line errors. No vllm needed: a stand-in engine class named like vLLM's routes
through the same path (tests/vllm/ starts a real engine).
"""

from __future__ import annotations

import json
import types

import pytest
import torch
import transformers as T

import eigenhooks as eh
from eigenhooks.engines.checkpoint import folder_adapter
from eigenhooks.engines.vllm.checkpoint import engine_adapter
from eigenhooks.models import UnsupportedModelError
from eigenhooks.models import vllm_weights as layouts
from eigenhooks.models.engines import EngineVerifyError
from eigenhooks.spectra import clear_memo
from eigenhooks.zoo import ModelLoadError

BASE = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip
# vLLM architecture -> (HF class, config class, overrides): one tiny GQA model each
ARCHS = {
    "LlamaForCausalLM": (T.LlamaForCausalLM, T.LlamaConfig, {}),
    "MistralForCausalLM": (T.MistralForCausalLM, T.MistralConfig, {}),
    "Qwen2ForCausalLM": (T.Qwen2ForCausalLM, T.Qwen2Config, {}),
    "Qwen3ForCausalLM": (T.Qwen3ForCausalLM, T.Qwen3Config, {"head_dim": 8}),
    "Phi3ForCausalLM": (T.Phi3ForCausalLM, T.Phi3Config, {"pad_token_id": 0}),
    "GemmaForCausalLM": (T.GemmaForCausalLM, T.GemmaConfig, {"head_dim": 16}),
    "Gemma2ForCausalLM": (T.Gemma2ForCausalLM, T.Gemma2Config, {"head_dim": 16, "query_pre_attn_scalar": 16}),
    "Olmo2ForCausalLM": (T.Olmo2ForCausalLM, T.Olmo2Config, {}),
    "Gemma3ForCausalLM": (T.Gemma3ForCausalLM, T.Gemma3TextConfig, {"head_dim": 16, "query_pre_attn_scalar": 16}),
    "GraniteForCausalLM": (T.GraniteForCausalLM, T.GraniteConfig, {"residual_multiplier": 0.5}),
}


def save(tmp_path, arch: str, seed: int = 0, dtype=torch.float32):
    cls, cfg_cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    model = cls(cfg_cls(**{**BASE, **extra})).to(dtype).eval()
    with torch.no_grad():  # norms away from 1, so ov_ln differs from ov
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.5 * torch.rand_like(p))
    assert sum(p.numel() for p in model.parameters()) < 100_000  # really tiny
    folder = tmp_path / arch
    model.save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["architectures"] == [arch]
    return model, folder


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("variant", ["ov", "ov_ln"])
def test_checkpoint_spectra_equal_transformers(tmp_path, arch, variant):
    model, folder = save(tmp_path, arch)
    clear_memo()
    want = eh.spectra(model, variant, cache=False)
    got = eh.spectra(folder_adapter(folder, torch.float32), variant, cache=False)
    assert len(got) == len(want) == BASE["num_hidden_layers"]
    for g, w in zip(got, want):
        ev_g, ev_w = (
            sorted(s.eigenvalues.tolist(), key=lambda z: (round(abs(z), 9), round(z.real, 9), z.imag)) for s in (g, w)
        )
        assert rel(torch.tensor(ev_g), torch.tensor(ev_w)) < 1e-6, (arch, g.layer)
        torch.testing.assert_close(g.basis.abs(), w.basis.abs(), rtol=1e-6, atol=1e-8)
        assert g.kind == w.kind


def test_merged_qkv_is_split_by_its_q_k_v_sizes(tmp_path):
    """Phi-3 stores q, k, v as one tensor: taking the q or k block as V gives another F (the test can fail)."""
    model, folder = save(tmp_path, "Phi3ForCausalLM")
    ad = folder_adapter(folder, torch.float32)
    a = model.model.layers[0].self_attn
    H, G, dh = 4, 2, 8
    want_V = a.qkv_proj.weight[(H + G) * dh :]
    torch.testing.assert_close(ad.factors(0).V_groups.reshape(G * dh, -1), want_V, rtol=0, atol=0)
    wrong = layouts.Layout("phi3", v="layers.{i}.self_attn.qkv_proj.weight", merged_qkv=False)
    with pytest.raises(UnsupportedModelError, match=r"V weight has shape \(64, 32\), expected \(16, 32\)"):
        layouts.checkpoint_adapter(
            {n: getattr(p, "data", p) for n, p in _named(model).items()},
            wrong,
            layouts.attention_dims(model.config),
            "x",
        )


def _named(model):
    return {k.removeprefix("model."): v for k, v in model.state_dict().items()}


def test_engine_dtype_is_the_dtype_read(tmp_path):
    """A float32 checkpoint served in bf16 (vLLM's dtype='auto' on CPU) has the bf16 spectrum."""
    model, folder = save(tmp_path, "LlamaForCausalLM")
    got = eh.spectra(folder_adapter(folder, torch.bfloat16), cache=False)
    want = eh.spectra(model.to(torch.bfloat16), cache=False)
    for g, w in zip(got, want):
        assert rel(g.eigenvalues.abs().sort().values, w.eigenvalues.abs().sort().values) < 1e-6


class LLM:  # a stand-in with vLLM's class name and module: what is_vllm_engine and engine_source read
    __module__ = "vllm.entrypoints.llm"

    def __init__(self, folder, arch, cfg, dtype=torch.float32, quantization=None):
        self.model_config = types.SimpleNamespace(
            model=str(folder), model_weights="", revision=None, dtype=dtype, architecture=arch,
            hf_text_config=cfg, quantization=quantization,
        )  # fmt: skip


def test_spectra_of_an_engine_reads_its_checkpoint(tmp_path):
    model, folder = save(tmp_path, "Qwen2ForCausalLM", seed=3)
    llm = LLM(folder, "Qwen2ForCausalLM", model.config)
    got, want = eh.spectra(llm, cache=False), eh.spectra(model, cache=False)
    for g, w in zip(got, want):
        assert rel(g.eigenvalues.abs().sort().values, w.eigenvalues.abs().sort().values) < 1e-6
    assert engine_adapter(llm) is engine_adapter(llm)  # read once


def test_engine_errors_are_one_line(tmp_path):
    model, folder = save(tmp_path, "LlamaForCausalLM")
    with pytest.raises(UnsupportedModelError, match=r"does not know vLLM's FooForCausalLM .* known: Gemma2ForCausalLM"):
        eh.spectra(LLM(folder, "FooForCausalLM", model.config))
    with pytest.raises(UnsupportedModelError, match="quantized \\(awq\\)"):
        eh.spectra(LLM(folder, "LlamaForCausalLM", model.config, quantization="awq"))
    with pytest.raises(EngineVerifyError, match=r"cannot probe a vllm.LLM.*eh.verify\(AutoModelForCausalLM"):
        eh.verify(LLM(folder, "LlamaForCausalLM", model.config))
    with pytest.raises(ModelLoadError, match="not a folder, and not in the local HF cache"):
        eh.spectra(LLM(tmp_path / "nowhere" / "x", "LlamaForCausalLM", model.config))
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(
        ModelLoadError, match=r"only pickled weights \(pytorch_model.bin\); eigenhooks reads safetensors"
    ):
        eh.spectra(LLM(folder, "LlamaForCausalLM", model.config), cache=False)


def test_a_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    model, folder = save(tmp_path, "LlamaForCausalLM")
    sd = load_file(folder / "model.safetensors")
    del sd["model.layers.1.self_attn.o_proj.weight"]
    save_file(sd, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"no tensor named 'layers.1.self_attn.o_proj.weight'"):
        folder_adapter(folder)


def test_checkpoint_attention_has_no_forward(tmp_path):
    _, folder = save(tmp_path, "LlamaForCausalLM")
    with pytest.raises(TypeError, match="has no forward"):
        folder_adapter(folder).model(torch.zeros(1, 2, dtype=torch.long))


def test_a_hub_id_is_found_in_the_local_cache_only(tmp_path):
    """An engine built from a hub id reads the snapshot vLLM downloaded (HF cache layout), never the network."""
    import shutil

    model, folder = save(tmp_path, "LlamaForCausalLM", seed=5)
    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--org--tiny"
    shutil.copytree(folder, repo / "snapshots" / rev)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    llm = LLM("org/tiny", "LlamaForCausalLM", model.config)
    llm.llm_engine = types.SimpleNamespace(
        vllm_config=types.SimpleNamespace(load_config=types.SimpleNamespace(download_dir=str(tmp_path / "hub")))
    )
    got, want = eh.spectra(llm, cache=False), eh.spectra(model, cache=False)
    assert rel(got[1].eigenvalues.abs().sort().values, want[1].eigenvalues.abs().sort().values) < 1e-6
    assert str(repo / "snapshots" / rev) in engine_adapter(llm).notes[0]
    with pytest.raises(
        ModelLoadError, match="'org/tiny' the engine loaded: not a folder, and not in the local HF cache"
    ):
        eh.spectra(LLM("org/tiny", "LlamaForCausalLM", model.config), cache=False)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "GemmaForCausalLM", "Phi3ForCausalLM"])
def test_head_spectra_and_the_full_ov_circuit(tmp_path, arch):
    """heads=True: each head's spectrum and its copying scores, the full OV circuit's (W_E, W_U, final norm
    read on demand; Gemma ties the LM head to the embedding) included."""
    model, folder = save(tmp_path, arch, seed=2)
    got = eh.spectra(folder_adapter(folder, torch.float32), heads=True, cache=False)
    want = eh.spectra(model, heads=True, cache=False)
    for g, w in zip(got, want):
        for hg, hw in zip(g.heads, w.heads):
            assert hg.circuit_copying == pytest.approx(hw.circuit_copying, rel=1e-6, abs=1e-9)
            assert hg.copying_score == pytest.approx(hw.copying_score, rel=1e-6, abs=1e-9)
            assert hg.circuit_copying == hg.circuit_copying  # not NaN
