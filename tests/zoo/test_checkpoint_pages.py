"""A checkpoint's mapped pages given back once read (``zoo.checkpoint.drop_resident``), never its data.

``read_tensors`` leaves tensors read in their stored dtype as maps of the safetensors file; after a plan is
built an engine's monitor never reads them again, so their pages are given back to the kernel. The tensors
must stay readable and equal (a page is faulted in again from the file), and memory that is not a clean
map of a file (a tensor copied into anonymous memory, whose pages the same call would zero) is left alone.
"""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import save_file

from eigenhooks.zoo import checkpoint

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps: Linux only")


def _resident_kb(path) -> int:
    """This process's resident kB of the maps of ``path``."""
    total, here = 0, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            parts = line.split()
            if parts and "-" in parts[0] and not parts[0].endswith(":"):
                here = len(parts) >= 6 and parts[5] == str(path)
            elif here and parts[0] == "Rss:":
                total += int(parts[1])
    return total


def test_mapped_pages_are_given_back_and_the_tensors_stay_equal(tmp_path):
    g = torch.Generator().manual_seed(0)
    want = {"layers.0.v": torch.randn(512, 1024, generator=g), "layers.0.o": torch.randn(1024, 512, generator=g)}
    save_file(want, tmp_path / "model.safetensors")
    got = checkpoint.read_tensors(tmp_path, list(want))
    assert all(torch.equal(got[k], want[k]) for k in want)  # every page read: resident
    path = (tmp_path / "model.safetensors").resolve()
    before = _resident_kb(path)
    assert before >= 2 * 2048 - 16  # 2 x 2 MB mapped and read
    given = checkpoint.drop_resident(got.values())
    assert given == before * 1024  # every page of the maps holding them, the partial ones at each end too
    assert _resident_kb(path) == 0
    assert all(torch.equal(got[k], want[k]) for k in want)  # read again from the file


def test_memory_that_is_not_a_clean_file_map_is_left_alone(tmp_path):
    t = {"w": torch.randn(1024, 1024)}
    save_file(t, tmp_path / "model.safetensors")
    mapped = checkpoint.read_tensors(tmp_path, ["w"])["w"]
    copied = mapped.clone()  # anonymous memory: MADV_DONTNEED would zero it
    cast = checkpoint.read_tensors(tmp_path, ["w"], torch.float64)["w"]  # a copy too
    assert checkpoint.drop_resident([copied, cast]) == 0
    assert torch.equal(copied, t["w"]) and torch.equal(cast, t["w"].double())
