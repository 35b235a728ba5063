"""Every family's norm scales, the blocks' (``ov_ln``) and the final one (the readout, the circuit, a
token's steering direction), against what each norm module computes (issue 52: Gemma's final norm was
folded as w, not 1 + w).

A norm computes s * x_hat + b with s = w + c (c = 0, or 1 for Gemma, Nemotron, Qwen3-Next...). The
module's own forward, with its bias set to 0 and its weight to 0 and then to 1, gives c * x_hat and
(1 + c) * x_hat, so x_hat and c, whatever the family calls its norm; s = w + c is what the adapter must say.
"""

from __future__ import annotations

import pytest
import torch
from cases import CASES

import eigenhooks as eh

NAMES = sorted(CASES)


def _measured_scale(norm: torch.nn.Module) -> torch.Tensor:
    """s (d,) with norm(x) = s * x_hat + b, from the module's forward (float64)."""
    w, b = norm.weight, getattr(norm, "bias", None)
    saved = w.detach().clone(), None if b is None else b.detach().clone()
    d = w.shape[-1]  # ALBERT's final norm is of the embedding width
    x = torch.randn(1, 3, d, generator=torch.Generator().manual_seed(0)).to(w.dtype)
    try:
        with torch.no_grad():
            if b is not None:
                b.zero_()
            y = norm(x).double()
            w.fill_(0)
            y0 = norm(x).double()
            w.fill_(1)
            y1 = norm(x).double()
    finally:
        with torch.no_grad():
            w.copy_(saved[0])
            if b is not None:
                b.copy_(saved[1])
    x_hat = y1 - y0  # (1, 3, d)
    ok = x_hat.abs() > 1e-3 * x_hat.abs().amax()
    s = torch.where(ok, y / torch.where(ok, x_hat, 1.0), torch.nan)
    return torch.nanmean(s.reshape(-1, s.shape[-1]), 0)


def _check(ours, norm, what):
    if getattr(norm, "weight", None) is None or not isinstance(norm.weight, torch.Tensor):
        assert ours is None, f"{what}: a norm without a weight has no scale to fold"
        return
    assert ours is not None and ours.dtype == torch.float64, f"{what}: expected a float64 scale"
    ref = _measured_scale(norm)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", NAMES)
def test_norm_scales_are_what_the_norms_compute(name, built):
    model = built(name)
    ad = eh.get_adapter(model)
    for i, ly in enumerate(ad.layers):
        if ly.norm is not None:
            _check(ad.norm_weight(i), ly.norm, f"{name} layer {i} ({type(ly.norm).__name__})")
    final = ad.final_norm()
    if final is not None:
        _check(ad.final_norm_scale(), final, f"{name} final norm ({type(final).__name__})")
