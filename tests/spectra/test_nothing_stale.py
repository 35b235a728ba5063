"""Caches that must never answer for weights other than the current ones (issue 41).

``p.data`` writes keep a parameter's version counter and its storage, and a sample of entries
misses most edits, so every cache keyed by the weights hashes all of their bytes. The spectra
memo's own tests are in tests/linalg/test_eig_against_numpy.py (``test_data_edits_are_never_answered_from_the_memo``).
"""

from __future__ import annotations

import copy
import importlib

import torch

import eigenhooks as eh

SHAPE = (2, 6)  # calibration sequences x tokens: small, the point is which weights sampled them


def _sample_tokens():
    """steer's remembered sampler, wherever it lives (edit.py, or calibration.py once split out)."""
    for name in ("eigenhooks.steer.calibration", "eigenhooks.steer.edit"):
        try:
            return importlib.import_module(name).sample_tokens
        except (ImportError, AttributeError):
            continue
    raise AssertionError("no sample_tokens in eigenhooks.steer")


def test_steer_calibration_sample_follows_a_data_edit():
    sample_tokens = _sample_tokens()
    model, tok = eh.zoo.load("gpt2-tiny")
    before = sample_tokens(model, SHAPE)
    target = tok.encode(" return")[0]
    bias = model.transformer.ln_f.bias
    # odd entries only: the old fingerprint's strided sample (every 8th of 128) saw none of them
    bias.data[1::2] += 10 * model.transformer.wte.weight.detach()[target, 1::2]
    after = sample_tokens(model, SHAPE)
    fresh = sample_tokens(copy.deepcopy(model), SHAPE)  # another model object, nothing remembered for it
    assert not torch.equal(fresh, before), "the edit does not change the sample: the test tests nothing"
    assert torch.equal(after, fresh), "calibration tokens sampled by the weights before the edit"
