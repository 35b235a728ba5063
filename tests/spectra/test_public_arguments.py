"""Every layer argument and every target list of the public API: a wrong one is refused in one line
that names the argument; numpy and torch integers count as ints, bools do not."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import eigenhooks as eh

N = 4  # gpt2-tiny's layers


@pytest.fixture(scope="module")
def gpt2():
    return eh.zoo.load("gpt2-tiny")


def _unit(d, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(d, generator=g, dtype=torch.float64)
    return u / u.norm()


def _calls(model, tok):
    """Each public entry point with a layer argument, as a function of that argument."""
    u = _unit(model.config.n_embd)
    ids = tok(["def f(x):"], return_tensors="pt")
    return {
        "steer": lambda x: eh.steer(model, u, layer=x, alpha=1.0),
        "iterate": lambda x: eh.iterate(model, ids, layer=x, steps=2),
        "spectra": lambda x: eh.spectra(model, layers=[x]),
        "verify": lambda x: eh.verify(model, layers=[x]),
        "contrast": lambda x: eh.direction.contrast(model, tok, ["def f(x):"], ["An expression"], layer=x),
    }


def _layer_of(name, result):
    if name == "steer":
        return result.layer
    if name == "iterate":
        return result.layer
    if name in ("spectra", "verify"):
        return result[0].layer
    return None  # contrast returns a vector


BAD_TYPES = [1.5, True, False, np.bool_(True), "1", None, torch.tensor([1, 2]), torch.tensor(1.0), [1]]
OUT_OF_RANGE = [N, 99, -N - 1, np.int64(-N - 1)]


@pytest.mark.parametrize("api", ["steer", "iterate", "spectra", "verify", "contrast"])
@pytest.mark.parametrize("bad", BAD_TYPES, ids=repr)
def test_a_layer_that_is_not_an_int_is_refused_naming_it(gpt2, api, bad):
    with pytest.raises(TypeError, match=r"layer.* must be an int.*got") as e:
        _calls(*gpt2)[api](bad)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("api", ["steer", "iterate", "spectra", "verify", "contrast"])
@pytest.mark.parametrize("bad", OUT_OF_RANGE, ids=repr)
def test_a_layer_out_of_range_is_refused_naming_the_range(gpt2, api, bad):
    with pytest.raises(IndexError, match=rf"layer {int(bad)} is out of range .* 0\.\.3 or -4\.\.-1") as e:
        _calls(*gpt2)[api](bad)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("api", ["steer", "iterate", "spectra", "verify", "contrast"])
@pytest.mark.parametrize("good", [np.int64(1), np.int32(1), torch.tensor(1), -3], ids=repr)
def test_numpy_torch_and_negative_integers_are_layers(gpt2, api, good):
    calls = _calls(*gpt2)
    got, ref = calls[api](good), calls[api](1)
    if api == "contrast":
        torch.testing.assert_close(got, ref)
    else:
        assert _layer_of(api, got) == _layer_of(api, ref) == 1
        assert type(_layer_of(api, got)) is int


@pytest.mark.parametrize("fn", ["spectra", "verify"])
@pytest.mark.parametrize("bad", [1, "0", 1.0])
def test_layers_must_be_a_list(gpt2, fn, bad):
    model, _ = gpt2
    with pytest.raises(TypeError, match=r"layers must be a list of layer indices"):
        getattr(eh, fn)(model, layers=bad)


# ---- targets ----


@pytest.mark.parametrize(
    "targets, match",
    [
        ([], r"at least one target"),
        ((), r"at least one target"),
        (None, r"targets must be a list"),
        ("ov/modulus", r"targets must be a list of targets, got the string 'ov/modulus'"),
        (("ov", "modulus"), r"targets is one target: wrap it in a list, targets=\[\('ov', 'modulus'\)\]"),
        (["ov/modulus"], r"a target is .* got the string 'ov/modulus'"),
        ([("ov",)], r"a target is .* got \('ov',\)"),
        ([("ov", "modulus", "x")], r"a target is .* got \('ov', 'modulus', 'x'\)"),
        ([3], r"a target is .* got 3"),
        ([("qk", "modulus")], r"variant must be one of"),
        ([(None, "modulus")], r"variant must be one of"),
        ([("ov", "largest")], r"rank must be one of"),
        ([("ov", "modulus"), ("ov", "modulus")], r"target names must be unique"),
    ],
    ids=repr,
)
def test_degenerate_target_lists_are_refused(gpt2, targets, match):
    model, _ = gpt2
    with pytest.raises(ValueError, match=match) as e:
        eh.monitor(model, targets=targets)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", [1, None, "", ("a",)], ids=repr)
def test_a_custom_target_needs_a_string_name(gpt2, name):
    model, _ = gpt2
    with pytest.raises(ValueError, match=r"name must be a non-empty string"):
        eh.monitor(model, targets=[(name, _unit(model.config.n_embd))])


@pytest.mark.parametrize("key", [np.int64(1), np.int32(1), torch.tensor(1), -3], ids=repr)
def test_numpy_torch_and_negative_layer_keys_are_layers(gpt2, key):
    model, _ = gpt2
    u = _unit(model.config.n_embd)
    mon = eh.monitor(model, targets=[("p", {key: u})])
    ref = eh.monitor(model, targets=[("p", {1: u})])
    assert list(mon.target_defs[0][3]) == list(ref.target_defs[0][3]) == [1]
    assert all(type(k) is int for k in mon.target_defs[0][3])


@pytest.mark.parametrize(
    "key, error, match",
    [
        (True, eh.TargetError, r"target 'p': layer key must be an int .*got True \(bool\)"),
        (np.bool_(False), eh.TargetError, r"target 'p': layer key must be an int"),
        (1.0, eh.TargetError, r"target 'p': layer key must be an int .*got 1\.0 \(float\)"),
        ("1", eh.TargetError, r"target 'p': layer key must be an int"),
        (N, eh.TargetError, r"target 'p': layer key 4 is out of range"),
        (-N - 1, eh.TargetError, r"target 'p': layer key -5 is out of range"),
    ],
    ids=repr,
)
def test_bad_layer_keys_are_refused(gpt2, key, error, match):
    model, _ = gpt2
    with pytest.raises(error, match=match):
        eh.monitor(model, targets=[("p", {key: _unit(model.config.n_embd)})])


def test_two_keys_for_one_layer_or_no_key_are_refused(gpt2):
    model, _ = gpt2
    u = _unit(model.config.n_embd)
    with pytest.raises(eh.TargetError, match=r"target 'p': layer keys 3 and -1 are both layer 3"):
        eh.monitor(model, targets=[("p", {3: u, -1: u})])
    with pytest.raises(eh.TargetError, match=r"target 'p': an empty dict"):
        eh.monitor(model, targets=[("p", {})])
