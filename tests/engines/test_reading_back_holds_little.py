"""What a process that only reads an engine's states back keeps (issue 57): the user's process of a vLLM engine
builds a plan from the checkpoint's tensors (``Monitor.states_only``) and then reads states into it. It keeps no
layer's spectrum (the table reads three facts of it), no page of the checkpoint once the plan is built (reading
a state back and its table read no weight: the fingerprint was taken while they were in memory), and no map of
the spectrum cache's entries. No vLLM needed: a checkpoint folder of a tiny Llama."""

from __future__ import annotations

import gc
import sys

import pytest
import torch
import transformers as T

import eigenhooks as eh
from eigenhooks.engines.checkpoint import drop_resident, folder_adapter
from eigenhooks.linalg.eig import LayerSpectrum
from eigenhooks.spectra import clear_memo

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
SETTINGS = dict(null_draws=4, null_stride=2, verdict_draws=19, verdict_tokens=16)


@pytest.fixture
def folder(tmp_path):
    cfg = T.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "llama")
    return tmp_path / "llama", model


def resident_kb(path_part: str) -> int:
    """This process's resident kB in maps of files whose path contains ``path_part``."""
    total, here = 0, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            parts = line.split()
            if parts and "-" in parts[0] and not parts[0].endswith(":"):
                here = len(parts) >= 6 and path_part in parts[5]
            elif here and parts[0] == "Rss:":
                total += int(parts[1])
    return total


def mapped(path_part: str) -> int:
    with open("/proc/self/maps") as fh:
        return sum(path_part in line for line in fh)


def test_reading_states_back_keeps_no_spectrum_and_no_checkpoint_page(folder, tmp_path):
    path, model = folder
    src = eh.Monitor(model, **SETTINGS)
    with src:
        model(torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1)))
    state, want = src.state_dict(), src.summary()
    del src
    clear_memo()
    gc.collect()
    mon = eh.Monitor(folder_adapter(path, torch.float32), attach=False, **SETTINGS).states_only()
    clear_memo()  # the process's memo of spectra: a cache anyone may clear; the plan must not need it
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, LayerSpectrum)]  # the plan kept facts, not spectra
    assert resident_kb(str(path)) > 0  # the plan read the weights through maps of the file
    drop_resident(mon.adapter)
    assert resident_kb(str(path)) == 0
    mon.load_state_dict(state)
    got = mon.summary()
    assert resident_kb(str(path)) == 0  # the fingerprint check and the table read no weight
    cols = [c for c in want.columns if c in got.columns]
    assert len(cols) == len(want.columns)
    import pandas as pd

    pd.testing.assert_frame_equal(got[cols], want[cols])


def test_spectra_read_from_the_cache_keep_no_map_of_its_entries(folder, tmp_path, monkeypatch):
    path, model = folder
    monkeypatch.setenv("EIGENHOOKS_CACHE", str(tmp_path / "entries"))
    eh.spectra(model)  # written to the cache
    clear_memo()
    kept = eh.spectra(model)  # read back from it
    assert kept[0].basis.abs().sum() > 0
    assert mapped(str(tmp_path / "entries")) == 0  # the entries' tensors were copied out, their maps closed
