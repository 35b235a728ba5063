"""Shared fixtures: seeded tiny models of every family, offline, with a private cache."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch
import transformers as T
from harness import FAMILY_CONFIGS, assert_tiny, build  # noqa: F401  (tests import them from harness, never from conftest)

# Fetched real models stay where `eigenhooks fetch` put them, whatever private spectrum cache a
# test sets: pin their folder for the session before any test changes EIGENHOOKS_CACHE.
from eigenhooks.zoo import real as _real  # noqa: E402

os.environ.setdefault("EIGENHOOKS_MODELS", str(_real.models_dir()))
REAL_NAME = "smollm2-135m"


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
    """name -> the seeded model of that tests/cases/ case, built once per test module."""
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
