"""The in-process memo of spectra is bounded by its tensors' bytes as well as by its count: an 8B model's 512
entries would hold ~1 GB of eigenvectors. Least recently used entries go first; the newest always stays; what
``get`` gives is a copy."""

from __future__ import annotations

import torch

from eigenhooks.linalg.eig import LayerSpectrum
from eigenhooks.spectra import clear_memo, memo


def spectrum(layer: int, d: int = 64, top: int = 8) -> LayerSpectrum:
    g = torch.Generator().manual_seed(layer)
    vals = torch.randn(d, dtype=torch.complex128, generator=g)
    return LayerSpectrum(layer, "ov", "modulus", vals, torch.randn(d, top, dtype=torch.complex128, generator=g),
                         torch.randn(d, 1, dtype=torch.float64, generator=g), 1, 0.5, "real-dominant", 0j)  # fmt: skip


def test_the_memo_keeps_at_most_its_bytes_least_recently_used_first(monkeypatch):
    clear_memo()
    one = memo._nbytes(spectrum(0))
    assert one == 64 * 16 + 64 * 8 * 16 + 64 * 8  # eigenvalues, eigenvectors, basis
    monkeypatch.setattr(memo, "_MEMO_BYTES", 3 * one)
    for i in range(3):
        memo.put(("k", i), spectrum(i))
    assert memo.get(("k", 0)) is not None  # 0 is now the most recently used
    memo.put(("k", 3), spectrum(3))  # a fourth: the least recently used (1) goes
    assert memo.get(("k", 1)) is None
    assert all(memo.get(("k", i)) is not None for i in (0, 2, 3))
    assert sum(n for _, n in memo._MEMO.values()) <= 3 * one
    got = memo.get(("k", 3))
    got.eigenvectors.zero_()  # a copy: the memo's entry is untouched
    assert memo.get(("k", 3)).eigenvectors.abs().sum() > 0
    monkeypatch.setattr(memo, "_MEMO_BYTES", one // 2)
    memo.put(("k", 4), spectrum(4))  # larger than the bound alone: it stays, the others go
    assert list(memo._MEMO) == [("k", 4)]
    clear_memo()
