"""The real-model tier for head targets: SmolLM2-135M (GQA: 9 query heads read 3 kv groups, 30 layers).

Each query head's subspace is measured at every layer: 270 rows with finite rho, their own BH family,
and a head read as a custom target (its basis from the heads=True spectra) gives the same row.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import eigenhooks as eh
from eigenhooks.monitor import stats as M

pytestmark = pytest.mark.real
TEXTS = [
    "The capital of France is Paris, and the capital of Italy is Rome. " * 3,
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n" * 3,
    "Water boils at one hundred degrees Celsius at sea level, less on a mountain. " * 3,
]


def test_head_targets_on_smollm2(smollm2):
    model, tok = smollm2
    layers = [0, 13, 29]
    specs = eh.spectra(model, heads=True)
    probe = {i: specs[i].heads[4].basis for i in layers}  # query head 4 reads kv group 1
    targets = [("ov", "modulus"), ("ov_head", "modulus"), ("head4", probe)]
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    with eh.monitor(model, targets=targets, null_stride=1) as mon, torch.no_grad():
        model(**batch)
    df = mon.summary()
    head = df[df["head"].notna()]
    assert len(head) == 270 and sorted(set(head["head"])) == list(range(9))
    assert (head.groupby("layer").size() == 9).all() and head["layer"].nunique() == 30
    assert np.isfinite(head["rho"]).all() and np.isfinite(head["gamma_mid"]).all()
    assert (head["n_tokens"] == int(batch["attention_mask"].sum())).all()
    assert (head["null_tokens"] >= M.MIN_NULL_TOKENS).all() and head["p_null"].notna().all()
    assert df.loc[df["head"].isna(), "target"].value_counts().to_dict() == {"ov/modulus": 30, "head4": 3}
    # the head's row is its basis as a custom target (the same layer, the same tokens and draws)
    for i in layers:
        mine = df[(df["layer"] == i) & (df["target"] == "head4")].iloc[0]
        row = head[(head["layer"] == i) & (head["head"] == 4)].iloc[0]
        for col in ("n_tokens", "k", "rho", "rho_ci_lo", "rho_ci_hi", "null_rho_lo", "null_rho_hi", "p_null"):
            assert row[col] == mine[col] or (math.isnan(row[col]) and math.isnan(mine[col])), (i, col)
        assert abs(row["gamma_pre"] - mine["gamma_pre"]) < 1e-12
    # the head rows are their own BH family: q over their distinct p only
    assert head["q_null"].notna().all() and (head["q_null"] >= head["p_null"] - 1e-15).all()
