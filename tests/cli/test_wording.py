"""One line, one clear message: a folder given as --file, --null-stride 0, a bogus --device, no doubled prefix."""

from __future__ import annotations

import warnings

import pytest
import torch
from typer.testing import CliRunner

from eigenhooks.cli import app
from eigenhooks.run.commandline import one_line_warnings

runner = CliRunner()


def _one_error(args) -> str:
    r = runner.invoke(app, args)
    lines = r.output.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1 and lines[0].startswith("eigenhooks: error: "), r.output
    return lines[0].removeprefix("eigenhooks: error: ")


def test_a_folder_given_as_file(tmp_path):
    msg = _one_error(["run", "--max-tokens", "64", "--out", str(tmp_path / "o"), "--file", str(tmp_path)])
    assert msg == f"--file {tmp_path} is a folder, not a file: name a text file in it (or pass the folder to --dataset)"


def test_null_stride_zero_does_not_offer_none(tmp_path):
    msg = _one_error(["run", "--max-tokens", "64", "--out", str(tmp_path / "o"), "--null-stride", "0"])
    assert msg == "--null-stride must be a positive int (1: every token), got 0"


def test_a_bogus_device_is_named_without_torchs_list(tmp_path):
    msg = _one_error(["run", "--max-tokens", "64", "--out", str(tmp_path / "o"), "--device", "bogus"])
    assert msg == "--device 'bogus' is not a device: give cpu, cuda, cuda:1, mps ..."
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_cuda_without_cuda_says_so(tmp_path):
    msg = _one_error(["run", "--max-tokens", "64", "--out", str(tmp_path / "o"), "--device", "cuda:1"])
    assert msg.startswith("--device cuda:1: this torch sees no CUDA device")


def test_a_warning_is_prefixed_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # restored after the test
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    monkeypatch.setenv("EIGENHOOKS_CACHE", str(blocker))
    r = runner.invoke(app, ["spectrum", "gpt2-tiny"])
    assert r.exit_code == 0, r.output
    said = [x for x in r.output.splitlines() if "warning" in x]
    assert said and said[0].startswith("eigenhooks: warning: cannot write the spectrum cache"), said
    assert "eigenhooks: warning: eigenhooks:" not in r.output
    one_line_warnings()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("eigenhooks: a sink failed on exit", RuntimeWarning, stacklevel=1)  # other category
    assert capsys.readouterr().err.strip() == "eigenhooks: warning: a sink failed on exit"
