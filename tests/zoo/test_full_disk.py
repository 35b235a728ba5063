"""A disk that fills while a GGUF is converted into the model cache: the model loads without the cache."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

import eigenhooks as eh
from eigenhooks.zoo import store


def test_a_full_disk_while_converting_loads_without_the_cache(tiny, monkeypatch):
    import transformers.modeling_utils as mu

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)  # part of the file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(mu, "safe_save_file", full)
    path, written = tiny
    with pytest.warns(
        eh.zoo.ModelCacheWarning, match=r"is full \(No space left on device\); converting the GGUF without"
    ):
        m, _ = eh.load_model(str(path))
    for name, p in written.state_dict().items():
        torch.testing.assert_close(m.state_dict()[name], p, rtol=0, atol=0)
    left = list(store.converted_dir().iterdir()) if store.converted_dir().exists() else []
    assert not [p for p in left if not p.name.endswith(".lock")], left  # no half entry, no build folder


def test_other_write_errors_still_raise(tiny, monkeypatch):
    import transformers.modeling_utils as mu

    def broken(tensors, filename, metadata=None):
        raise OSError(errno.EIO, "Input/output error", filename)

    monkeypatch.setattr(mu, "safe_save_file", broken)
    with pytest.raises(OSError, match="Input/output error"):
        eh.load_model(str(tiny[0]))
