"""The monitor's settings are MonitorConfig's fields: ``eh.monitor`` and ``eh.Monitor`` take exactly
those (their signatures are made from it), the pre-0.2 names K, Kf, m still work with a
DeprecationWarning, and a misspelt setting is refused naming the settings there are."""

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


@pytest.mark.parametrize(("old", "new"), [("K", "null_draws"), ("Kf", "fnull_draws"), ("m", "eig_top")])
def test_the_old_names_warn_and_still_work(model, old, new):
    with pytest.warns(DeprecationWarning, match=f"{old}= is deprecated: use {new}="):
        mon = eh.monitor(model, **{old: 2})
    assert getattr(mon.config, new) == 2
    with pytest.warns(DeprecationWarning, match=f"Monitor.{old} is deprecated"):
        assert getattr(mon, old) == 2


def test_a_misspelt_setting_is_refused_naming_the_settings(model):
    with pytest.raises(TypeError, match="nul_draws.*null_draws"):
        eh.monitor(model, nul_draws=3)
    with pytest.raises(TypeError, match="repeated"):
        eh.monitor(model, [("ov", "modulus")], targets=[("ov", "residual")])
