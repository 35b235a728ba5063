"""Caches that must never answer for weights other than the current ones (issue 41).

``p.data`` writes keep a parameter's version counter and its storage, and a sample of entries
misses most edits, so every cache keyed by the weights hashes all of their bytes. The spectra
memo's own tests are in test_spectrum.py (``test_data_edits_are_never_answered_from_the_memo``).
"""

from __future__ import annotations

import torch

import eigenhooks as eh
from eigenhooks.steer import edit

SHAPE = (2, 6)  # calibration sequences x tokens: small, the point is which weights sampled them


def test_steer_calibration_sample_follows_a_data_edit():
    model, tok = eh.zoo.load("gpt2-tiny")
    before = edit.sample_tokens(model, SHAPE)
    target = tok.encode(" return")[0]
    bias = model.transformer.ln_f.bias
    # odd entries only: the old fingerprint's strided sample (every 8th of 128) saw none of them
    bias.data[1::2] += 10 * model.transformer.wte.weight.detach()[target, 1::2]
    after = edit.sample_tokens(model, SHAPE)
    fresh = edit._sample_tokens(model, SHAPE, 0)  # no memo: what these weights sample
    assert not torch.equal(fresh, before), "the edit does not change the sample: the test tests nothing"
    assert torch.equal(after, fresh), "calibration tokens sampled by the weights before the edit"
