"""Sink tags are unique per (layer, target): two target names that map to one tag are refused at entry."""

from __future__ import annotations

import pytest
import torch

import eigenhooks as eh
from eigenhooks.monitor.sinks import check_tags


@pytest.fixture(scope="module")
def gpt2():
    return eh.zoo.load("gpt2-tiny")


def test_check_tags_names_both_targets():
    check_tags(["ov/modulus", "ov/residual", "mine", "mine.v2"])  # distinct tags: nothing raised
    with pytest.raises(ValueError, match=r"targets 'a/b' and 'a-b' share the sink tag '\.\.\./a-b'"):
        check_tags(["a/b", "a-b"])


@pytest.mark.parametrize(
    "names",
    [(("ov", "modulus"), "ov-modulus"), ("a/b", "a-b"), ("a b", "a:b")],
)
def test_colliding_targets_are_refused_before_any_hook(gpt2, names):
    model, _ = gpt2
    d = model.config.n_embd
    u = torch.randn(d, generator=torch.Generator().manual_seed(0))
    targets = [n if isinstance(n, tuple) else (n, u / u.norm()) for n in names]
    shown = [f"{n[0]}/{n[1]}" if isinstance(n, tuple) else n for n in names]
    hooks_before = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    with pytest.raises(ValueError, match=rf"targets '{shown[0]}' and '{shown[1]}' share the sink tag"):
        eh.monitor(model, targets=targets, sink=lambda step, values: None)
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == hooks_before
