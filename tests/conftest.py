"""Shared fixtures: seeded tiny models of every family, offline, with a private cache."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch
import transformers as T
from harness import DECODER_BASE  # the tiny Llama-style config the decoder cases use

# Fetched real models stay where `eigenhooks fetch` put them, whatever private spectrum cache a
# test sets: pin their folder for the session before any test changes EIGENHOOKS_CACHE.
from eigenhooks.zoo import real as _real  # noqa: E402

os.environ.setdefault("EIGENHOOKS_MODELS", str(_real.models_dir()))
REAL_NAME = "smollm2-135m"

MAX_PARAMS = 200_000  # a misspelt config key must not silently build a full-size model

# family -> (model class with a head, bare class, config)
FAMILY_CONFIGS = {
    "gpt2": (
        T.GPT2LMHeadModel,
        T.GPT2Model,
        lambda: T.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=64, n_positions=32),
    ),
    "distilgpt2": (
        T.GPT2LMHeadModel,
        T.GPT2Model,
        lambda: T.GPT2Config(n_layer=3, n_head=4, n_embd=16, vocab_size=64, n_positions=32),
    ),
    "gpt_neo": (
        T.GPTNeoForCausalLM,
        T.GPTNeoModel,
        lambda: T.GPTNeoConfig(
            num_layers=2,
            num_heads=2,
            hidden_size=16,
            vocab_size=64,
            max_position_embeddings=32,
            attention_types=[[["global", "local"], 1]],
            window_size=4,
        ),
    ),
    "gpt_neox": (
        T.GPTNeoXForCausalLM,
        T.GPTNeoXModel,
        lambda: T.GPTNeoXConfig(
            num_hidden_layers=2,
            num_attention_heads=2,
            hidden_size=16,
            intermediate_size=32,
            vocab_size=64,
            max_position_embeddings=32,
        ),
    ),
    "gptj": (
        T.GPTJForCausalLM,
        T.GPTJModel,
        lambda: T.GPTJConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=64, rotary_dim=4, n_positions=32),
    ),
    "bert": (
        T.BertForMaskedLM,
        T.BertModel,
        lambda: T.BertConfig(
            num_hidden_layers=2,
            num_attention_heads=2,
            hidden_size=16,
            intermediate_size=32,
            vocab_size=64,
            max_position_embeddings=32,
        ),
    ),
    "roberta": (
        T.RobertaForMaskedLM,
        T.RobertaModel,
        lambda: T.RobertaConfig(
            num_hidden_layers=2,
            num_attention_heads=2,
            hidden_size=16,
            intermediate_size=32,
            vocab_size=64,
            max_position_embeddings=40,
        ),
    ),
    "distilbert": (
        T.DistilBertForMaskedLM,
        T.DistilBertModel,
        lambda: T.DistilBertConfig(
            n_layers=2, n_heads=2, dim=16, hidden_dim=32, vocab_size=64, max_position_embeddings=32
        ),
    ),
    "albert": (
        T.AlbertForMaskedLM,
        T.AlbertModel,
        lambda: T.AlbertConfig(
            num_hidden_layers=4,
            num_hidden_groups=2,
            num_attention_heads=2,
            hidden_size=16,
            embedding_size=8,
            intermediate_size=32,
            vocab_size=64,
            max_position_embeddings=32,
        ),
    ),
    "albert_inner2": (
        T.AlbertForMaskedLM,
        T.AlbertModel,
        lambda: T.AlbertConfig(
            num_hidden_layers=2,
            num_hidden_groups=1,
            inner_group_num=2,
            num_attention_heads=2,
            hidden_size=16,
            embedding_size=16,
            intermediate_size=32,
            vocab_size=64,
            max_position_embeddings=32,
        ),
    ),
    "llama": (
        T.LlamaForCausalLM,
        T.LlamaModel,
        lambda: T.LlamaConfig(**DECODER_BASE),
    ),
    "mistral": (
        T.MistralForCausalLM,
        T.MistralModel,
        lambda: T.MistralConfig(**{**DECODER_BASE, "num_key_value_heads": 1, "head_dim": 4}),
    ),
    "qwen2": (
        T.Qwen2ForCausalLM,
        T.Qwen2Model,
        lambda: T.Qwen2Config(**DECODER_BASE),
    ),
    "opt": (
        T.OPTForCausalLM,
        T.OPTModel,
        lambda: T.OPTConfig(
            num_hidden_layers=2,
            num_attention_heads=2,
            hidden_size=16,
            ffn_dim=32,
            vocab_size=64,
            word_embed_proj_dim=16,
            max_position_embeddings=32,
        ),
    ),
    "opt_postnorm": (
        T.OPTForCausalLM,
        T.OPTModel,
        lambda: T.OPTConfig(
            num_hidden_layers=2,
            num_attention_heads=2,
            hidden_size=16,
            ffn_dim=32,
            vocab_size=64,
            word_embed_proj_dim=16,
            max_position_embeddings=32,
            do_layer_norm_before=False,
        ),
    ),
}


def assert_tiny(model) -> None:
    n = sum(p.numel() for p in model.parameters())
    assert n < MAX_PARAMS, f"{type(model).__name__} has {n} parameters: not a tiny test model"


def build(family: str, bare: bool = False, dtype=torch.float64, seed: int = 0, std: float = 0.3):
    """A seeded tiny model of `family`, its weights redrawn at `std` so F is O(1)."""
    head_cls, bare_cls, cfg = FAMILY_CONFIGS[family]
    torch.manual_seed(seed)
    model = (bare_cls if bare else head_cls)(cfg())
    assert_tiny(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model.to(dtype).eval()


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EIGENHOOKS_CACHE", str(tmp_path / "cache"))
    from eigenhooks.spectra import clear_memo

    clear_memo()  # no test sees another's in-process spectra


@pytest.fixture
def tiny():
    return build


@pytest.fixture(scope="module")
def built():
    """name -> the seeded model of that tests/cases_*.py case, built once per test module."""
    from cases import CASES

    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = CASES[name].build()
        return cache[name]

    return get


def pytest_collection_modifyitems(config, items):
    """The `real` tier skips, saying why, when the weights are absent; CI sets
    EIGENHOOKS_REQUIRE_REAL=1 so that absent weights fail instead of skipping."""
    if _real.is_fetched(REAL_NAME) or os.environ.get("EIGENHOOKS_REQUIRE_REAL") == "1":
        return
    why = pytest.mark.skip(
        reason=f"real model {REAL_NAME} not fetched (run `eigenhooks fetch {REAL_NAME}`; .ci/run does it first)"
    )
    for item in items:
        if "real" in item.keywords:
            item.add_marker(why)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the fetched SmolLM2-135M-Instruct, float32, eval mode, loaded once."""
    import eigenhooks as eh

    return eh.zoo.load(REAL_NAME)


def pytest_sessionfinish(session, exitstatus):
    """Write docs/coverage.md when every architecture case ran every check and the run passed."""
    from harness import COLUMNS, RESULTS, write_table

    if exitstatus != 0 or not RESULTS:  # no case ran: nothing to write (and cases need transformers 5)
        return
    from cases import CASES

    if all((n, c) in RESULTS for n in CASES for c in COLUMNS):
        import pathlib

        versions = f"transformers {T.__version__}, torch {torch.__version__}"
        write_table(pathlib.Path(__file__).parent.parent / "docs" / "coverage.md", sorted(CASES), versions)
