"""The monitor's settings are MonitorConfig's fields: ``eh.monitor`` and ``eh.Monitor`` take exactly
those (their signatures are made from it), each setting reads as the config's own value on the monitor
(no other name, no second default), and a misspelt or retired setting is refused naming the settings there are."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import eigenhooks as eh
from eigenhooks.monitor.config import DEFAULTS, MonitorConfig


@pytest.fixture(scope="module")
def model():
    return eh.zoo.load("gpt2-tiny")[0]


def test_the_signatures_are_the_configs_fields():
    want = [f.name for f in dataclasses.fields(MonitorConfig)]
    for fn in (eh.monitor, eh.Monitor):
        params = inspect.signature(fn).parameters
        assert set(want) <= set(params), fn
        assert list(params)[:4] == ["model", *want[:3]]  # targets, reading_points, tokens by position
        for name in want:
            assert params[name].default == getattr(DEFAULTS, name), (fn, name)


def test_every_setting_reaches_the_config_by_keyword_and_by_position(model):
    mon = eh.monitor(model, [("ov", "modulus")], ("pre", "mid"), True, null_draws=3, eig_top=0, null_seed=9)
    c = mon.config
    assert (c.targets, c.reading_points, c.tokens) == ((("ov", "modulus"),), ("pre", "mid"), True)
    assert (c.null_draws, c.eig_top, c.null_seed) == (3, 0, 9)
    assert (mon.null_draws, mon.eig_top, mon.null_seed, mon.attach) == (3, 0, 9, True)
    assert eh.Monitor(model, fnull_draws=2).config.fnull_draws == 2


@pytest.mark.parametrize("old", ["K", "Kf", "m", "points", "keep_tokens"])
def test_names_before_the_config_are_gone(model, old):
    with pytest.raises(TypeError, match="unexpected.*null_draws"):
        eh.monitor(model, **{old: 2})
    with pytest.raises(AttributeError, match=old):
        getattr(eh.monitor(model), old)


@pytest.mark.parametrize("given", [None, 1, 3])
def test_the_null_stride_is_one_value_from_the_call_to_the_bases(model, given):
    """None means every token: the config says 1 once, and the monitor and each layer's bases read that."""
    mon = eh.monitor(model, null_stride=given, null_draws=2, fnull_draws=0, eig_top=0)
    want = 1 if given is None else given
    assert mon.config.null_stride == mon.null_stride == want
    mon._prepare()
    assert {lp.bases.null_stride for lp in mon._plan.layers.values()} == {want}


def test_a_misspelt_setting_is_refused_naming_the_settings(model):
    with pytest.raises(TypeError, match="nul_draws.*null_draws"):
        eh.monitor(model, nul_draws=3)
    with pytest.raises(TypeError, match="repeated"):
        eh.monitor(model, [("ov", "modulus")], targets=[("ov", "residual")])
