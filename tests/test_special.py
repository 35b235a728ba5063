"""The linear F stated for attention sinks is the model's own map with the sinks switched off."""

from cases import CASES

import eigenhooks as eh
from eigenhooks.models.probe import probe_matrices


def test_gpt_oss_F_is_the_probe_with_sinks_at_minus_infinity():
    model = CASES["gpt_oss (sinks)"].build()
    ad = eh.get_adapter(model)
    with_sinks = probe_matrices(ad)
    for ly in ad.layers:
        ly.block.self_attn.sinks.data.fill_(-1e4)  # exp(-1e4) = 0 in float32: no sink mass
    without = probe_matrices(ad)
    for i in range(ad.n_layers):
        F = ad.factors(i).matrix()
        scale = float(F.abs().max())
        assert float((F - without[i]).abs().max()) / scale < 1e-5
        assert float((F - with_sinks[i]).abs().max()) / scale > 1e-3  # the sinks really change the map
