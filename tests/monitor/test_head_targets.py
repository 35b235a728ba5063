"""Head targets (``("ov_head", rank)``): each query head's principal subspace measured as a target.

Checked against what they must equal: the same bases given as custom targets (every statistic and
count column), the layer rows of a monitor without head targets (unchanged, q included: the head
rows are a BH family of their own), and BH written out by hand over the head rows alone. The fast
path against the float64 reference is in test_reference.py (``test_head_targets``).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
import transformers as T
from harness import DECODER_BASE  # the decoder cases' tiny GQA Llama

import eigenhooks as eh
from eigenhooks.models import get_adapter
from eigenhooks.monitor import stats as M

from .summaries import bh_by_hand

COUNTS = ["n_tokens", "n_nonfinite", "n_sequences", "null_tokens", "k"]
FROM_COUNTS = [  # columns made from counts alone: equal counts give equal numbers
    "rho", "rho_ci_lo", "rho_ci_hi", "design_effect", "rho_null_tokens", "null_rho_mean", "null_rho_lo", "null_rho_hi",
    "rho_percentile", "p_null", "lift", "p_binom",
]  # fmt: skip
MEANS = ["gamma_pre", "gamma_mid", "gamma_post", "delta_mean", "null_gamma_pre_lo", "null_gamma_pre_hi"]
LAYER_F = ["eig_rank", "eig_rho_median", "fnull_rho_mean", "fnull_percentile"]  # the layer's F: eig and F-null
SETTINGS = dict(null_stride=1, null_draws=64, fnull_draws=8, eig_top=4)


@pytest.fixture(scope="module")
def gpt2():
    return eh.zoo.load("gpt2-tiny")[0]


@pytest.fixture(scope="module")
def llama():
    """A tiny GQA Llama: query heads share key/value groups."""
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(**{**DECODER_BASE, "max_position_embeddings": 256})).eval()
    ad = get_adapter(model)
    assert ad.n_kv_heads < ad.n_heads
    return model


def _ids(model, n_seq=2, n=100, seed=0):
    vocab = get_adapter(model).model.config.vocab_size
    return torch.randint(0, vocab, (n_seq, n), generator=torch.Generator().manual_seed(seed))


def _summary(model, targets, **kw):
    with eh.monitor(model, targets=targets, **{**SETTINGS, **kw}) as mon, torch.no_grad():
        model(input_ids=_ids(model))
    return mon, mon.summary()


def _custom(model, rank):
    """The heads' bases given back as custom targets, one per head: {layer: basis}."""
    specs = eh.spectra(model, rank=rank, heads=True)
    H = get_adapter(model).n_heads
    out = [(f"h{h}", {s.layer: s.heads[h].basis for s in specs if s.heads[h].k > 0}) for h in range(H)]
    return [t for t in out if t[1]]


@pytest.mark.parametrize("rank", ["modulus", "residual"])
@pytest.mark.parametrize("which", ["gpt2", "llama"])
def test_head_rows_equal_their_bases_as_custom_targets(request, which, rank):
    model = request.getfixturevalue(which)
    _, heads = _summary(model, [("ov_head", rank)])
    _, custom = _summary(model, _custom(model, rank))
    ad = get_adapter(model)
    assert len(heads) == ad.n_layers * ad.n_heads  # no zero head in these models
    assert heads["head"].tolist() == [h for _ in range(ad.n_layers) for h in range(ad.n_heads)]
    assert heads["target"].tolist() == [f"ov_head/{rank}/h{h}" for h in heads["head"]]
    assert (heads["variant"] == "ov").all() and (heads["rank"] == rank).all()
    custom = custom.assign(head=custom["target"].str[1:].astype(int)).sort_values(["layer", "head"])
    custom = custom.reset_index(drop=True)
    assert custom["layer"].tolist() == heads["layer"].tolist() and custom["head"].tolist() == heads["head"].tolist()
    assert (heads["null_tokens"] >= M.MIN_NULL_TOKENS).all() and heads["p_null"].notna().all()
    # the eigen-subspaces and F-null frames are the layer F's: a custom target's are (ov, modulus)'s
    exact = COUNTS + FROM_COUNTS + ["q_null", "verdict"] + (LAYER_F if rank == "modulus" else [])
    for c in exact:
        assert heads[c].tolist() == custom[c].tolist() or np.array_equal(heads[c], custom[c], equal_nan=True), c
    for c in MEANS:
        np.testing.assert_allclose(heads[c], custom[c], rtol=1e-12, atol=1e-12, err_msg=c)
    # kind, |lambda_1| and gap are the head's own spectrum's
    specs = eh.spectra(model, rank=rank, heads=True)
    own = [abs(specs[la].heads[h].lambda_1) for la, h in zip(heads["layer"], heads["head"])]
    np.testing.assert_allclose(heads["abs_lambda_1"], own, rtol=1e-12)


def test_layer_rows_are_unchanged_by_head_targets(gpt2):
    """Adding head targets moves no layer row (the null draws, p, q, the verdict: every column), even where a
    head's subspace is a plane beside a layer's line; the head rows' q is BH over their own hypotheses."""
    layer_targets = [("ov", "modulus"), ("ov", "residual"), ("probe", torch.eye(128, dtype=torch.float64)[:, 3])]
    _, alone = _summary(gpt2, layer_targets)
    _, both = _summary(gpt2, layer_targets + [("ov_head", "modulus"), ("ov_head", "residual")])
    specs = eh.spectra(gpt2, heads=True)
    assert any(s.k == 1 and max(p.k for p in s.heads) == 2 for s in specs)  # frames widened for a head there
    rows = both[both["head"].isna()].drop(columns="head").reset_index(drop=True)
    pd.testing.assert_frame_equal(rows, alone)
    head = both[both["head"].notna()]
    assert (head["null_tokens"] >= M.MIN_NULL_TOKENS).all()
    # one hypothesis per distinct (layer, subspace) among the head rows (modulus and residual often agree)
    distinct, seen = [], {}
    for _, r in head.iterrows():
        reps = seen.setdefault(r["layer"], [])
        U = _basis(gpt2, r)
        if not any(M.same_subspace(U, V) for V in reps):
            reps.append(U)
            distinct.append(r["p_null"])
    assert len(distinct) < len(head)
    want = dict(zip(distinct, bh_by_hand(distinct)))
    np.testing.assert_allclose(head["q_null"], [want[p] for p in head["p_null"]], rtol=1e-12)


def _basis(model, r):
    return eh.spectra(model, rank=r["rank"], heads=True)[r["layer"]].heads[int(r["head"])].basis


def test_state_round_trip_merge_and_fingerprint(gpt2):
    """A state with head targets loads and merges into a monitor of the same targets (sums doubled), and is
    refused by one without them, naming the difference."""
    targets = [("ov", "modulus"), ("ov_head", "modulus")]
    mon, df = _summary(gpt2, targets)
    state = mon.state_dict()
    assert "ov_head/modulus/h2" in state["fingerprint"]["layers"]["1"]["targets"]
    other = eh.monitor(gpt2, targets=targets, **SETTINGS)
    other.load_state_dict(state)
    pd.testing.assert_frame_equal(other.summary(), df)
    other.merge_state_dict(state)
    assert (other.summary()["n_tokens"] == 2 * df["n_tokens"]).all()
    plain = eh.monitor(gpt2, targets=[("ov", "modulus")], **SETTINGS)
    with pytest.raises(ValueError, match="targets"):
        plain.load_state_dict(state)
    assert set(mon.stats) == {(r["layer"], r["target"]) for r in df.to_dict("records")}


def test_sink_tags_and_bad_head_targets(gpt2, tmp_path):
    with pytest.raises(ValueError, match="share the sink tag"):
        eh.monitor(gpt2, targets=[("ov_head", "modulus"), ("ov_head-modulus-h1", torch.eye(128)[:, 0])])
    with pytest.raises(ValueError, match="rank must be one of"):
        eh.monitor(gpt2, targets=[("ov_head", "modulo")])
    with pytest.raises(ValueError, match="ov_head"):
        eh.monitor(gpt2, targets=[("ov_heads", "modulus")])
    seen = []
    with eh.monitor(gpt2, targets=[("ov_head", "modulus")], sink=lambda step, s: seen.append(s)), torch.no_grad():
        gpt2(input_ids=_ids(gpt2, 1, 10))
    assert "eigenhooks/rho/L03/ov_head-modulus-h3" in seen[-1] and not math.isnan(
        seen[-1]["eigenhooks/rho/L03/ov_head-modulus-h3"]
    )


@pytest.mark.parametrize(
    "name, what",
    [
        ("ov_head/modulus/h0", r"head 0 of the head target \('ov_head', 'modulus'\)"),
        ("ov_head/residual/h3", r"head 3 of the head target \('ov_head', 'residual'\)"),
        ("ov/residual", r"the target \('ov', 'residual'\)"),
        ("ov_ln/modulus", r"the target \('ov_ln', 'modulus'\)"),
    ],
)
def test_a_custom_target_never_takes_a_built_in_rows_name(gpt2, name, what):
    """('ov_head/modulus/h0', u) beside ('ov_head', 'modulus') gave two rows of one name and overwrote head 0
    in mon.stats and the sink tags (issue 52); a built-in row's name is refused, with or without its target."""
    u = torch.eye(128, dtype=torch.float64)[:, 0]
    for targets in ([("ov_head", "modulus"), (name, u)], [("ov", "modulus"), (name, u)]):
        with pytest.raises(ValueError, match=rf"target name '{name}' is a built-in row's name \({what}\)"):
            eh.monitor(gpt2, targets=targets)
    with eh.monitor(gpt2, targets=[("ov_head", "modulus"), ("ov_head/modulus/h0_probe", u)]):  # another name is fine
        pass
