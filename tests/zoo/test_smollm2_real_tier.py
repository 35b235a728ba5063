"""The real-model tier: SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised), fetched by `eigenhooks fetch`.

Each check compares eigenhooks with something it did not compute: the model's own forward,
numpy's eig of F read by our own formula, our own hooks, TransformerLens, or a Monte Carlo.
Skipped (with the reason) when the weights are absent; `.ci/run` fetches them first.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

import eigenhooks as eh
from eigenhooks.monitor.stats import alignment

pytestmark = pytest.mark.real
TEXTS = [
    "The capital of France is Paris, and the capital of Japan is",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Once upon a time there was a small robot who wanted to learn how to paint.",
    "Water boils at one hundred degrees Celsius at sea level.",
]


@pytest.fixture(scope="module")
def batch(smollm2):
    _, tok = smollm2
    tok.padding_side = "right"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    b = tok(TEXTS, return_tensors="pt", padding=True)
    assert (b["attention_mask"] == 0).any(), "the batch must contain padding"
    return b


def test_shape_is_smollm2(smollm2):
    model, _ = smollm2
    ad = eh.get_adapter(model)
    assert (ad.family, ad.n_layers, ad.d_model, ad.n_heads, ad.n_kv_heads) == ("llama", 30, 576, 9, 3)


def test_verify_all_30_layers(smollm2):
    rows = eh.verify(smollm2[0])
    assert len(rows) == 30
    worst = max(r.rel_diff for r in rows)
    print(f"\n[smollm2 verify] worst relative |F_weights - F_probe| over 30 layers: {worst:.2e}")
    assert all(math.isfinite(r.rel_diff) and r.rel_diff < 1e-5 for r in rows)


def _own_F(model, layer: int) -> np.ndarray:
    """F = sum_h O_h V_{g(h)} from the raw weights, by our own formula (GQA: repeat the kv groups)."""
    a = model.model.layers[layer].self_attn
    H, G = model.config.num_attention_heads, model.config.num_key_value_heads
    dh = model.config.hidden_size // H
    V = a.v_proj.weight.detach().double().reshape(G, dh, -1)  # (G, dh, d)
    V_full = V.repeat_interleave(H // G, 0).reshape(H * dh, -1)  # head h reads group h // (H/G)
    return (a.o_proj.weight.detach().double() @ V_full).numpy()


@pytest.mark.parametrize("layer", [0, 13, 29])
def test_spectrum_matches_numpy_eig(smollm2, layer):
    model, _ = smollm2
    F = _own_F(model, layer)
    ref = np.linalg.eigvals(F)
    s = eh.spectra(model, layers=[layer], cache=False)[0]
    top = ref[np.argmax(np.abs(ref))]
    assert min(abs(s.lambda_1 - top), abs(s.lambda_1 - np.conj(top))) < 1e-8 * max(1.0, abs(top))
    v = s.v_1.numpy()
    assert np.linalg.norm(F @ v - s.lambda_1 * v) < 1e-7 * abs(s.lambda_1)
    # the whole spectrum, as a multiset (rank <= 3 * 64 = 192: the rest is zero)
    got = np.sort_complex(np.round(s.eigenvalues.numpy(), 6))
    assert np.allclose(np.sort(np.abs(got)), np.sort(np.abs(ref)), atol=1e-6)


def _own_readings(model, batch):
    """pre and mid of every layer from our own pre-hooks on the two norms of each block."""
    pre, mid, hs = {}, {}, []
    for i, blk in enumerate(model.model.layers):
        hs.append(blk.input_layernorm.register_forward_pre_hook(lambda m, a, i=i: pre.__setitem__(i, a[0].detach())))
        hs.append(
            blk.post_attention_layernorm.register_forward_pre_hook(lambda m, a, i=i: mid.__setitem__(i, a[0].detach()))
        )
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for h in hs:
            h.remove()
    return pre, mid


def test_monitor_padded_batch_equals_own_hooks(smollm2, batch):
    model, _ = smollm2
    with eh.monitor(model, targets=[("ov", "modulus")]) as mon, torch.no_grad():
        model(**batch)
    df = mon.summary().set_index("layer")
    pre, mid = _own_readings(model, batch)
    mask = batch["attention_mask"].bool()
    specs = eh.spectra(model)
    for s in specs[::7]:
        U = s.basis.float()
        a_pre, a_mid = alignment(pre[s.layer].float(), U)[mask], alignment(mid[s.layer].float(), U)[mask]
        assert int(df.loc[s.layer, "n_tokens"]) == int(mask.sum())
        assert abs(df.loc[s.layer, "gamma_pre"] - float(a_pre.mean())) < 1e-5
        assert abs(df.loc[s.layer, "gamma_mid"] - float(a_mid.mean())) < 1e-5
        assert abs(df.loc[s.layer, "rho"] - float(((a_mid - a_pre) > 1e-6).float().mean())) < 1e-6


def test_generate_with_kv_cache_equals_one_forward(smollm2):
    model, tok = smollm2
    b = tok(["The capital of France is"], return_tensors="pt")
    with eh.monitor(model, targets=[("ov", "modulus")]) as mon, torch.no_grad():
        seq = model.generate(**b, max_new_tokens=8, do_sample=False)
    full = seq[:, :-1]  # the last token is never fed back
    with eh.monitor(model, targets=[("ov", "modulus")]) as ref, torch.no_grad():
        model(input_ids=full, attention_mask=torch.ones_like(full))
    a, r = mon.summary(), ref.summary()
    assert (a["n_tokens"] == full.shape[1]).all() and (a["n_sequences"] == 1).all()
    assert (a["rho"] - r["rho"]).abs().max() < 1e-6
    assert (a["gamma_pre"] - r["gamma_pre"]).abs().max() < 2e-4  # cached attention vs full: fp32 rounding


def test_random_targets_are_calibrated(smollm2, batch):
    """20 Haar-random custom targets: p_null < 0.05 for about 5% of (target, layer) pairs; p_binom is not.
    The table is under the global null (no target has a role), so it rejects nothing at q < 0.05
    (its FDR is P(any rejection) <= 0.05; tests/monitor/test_one_subspace_one_verdict.py measures
    that rate over many tables). Each text twice, and the nulls read on every token: p is NaN below
    MIN_NULL_TOKENS null tokens, and the four texts alone have about 60."""
    model, tok = smollm2
    batch = tok([t + " " + t for t in TEXTS], return_tensors="pt", padding=True)  # the fixture set the padding
    g = torch.Generator().manual_seed(123)
    targets = []
    for j in range(20):
        u = torch.randn(576, generator=g, dtype=torch.float64)
        targets.append((f"rand{j}", u / u.norm()))
    with (
        eh.monitor(model, targets=targets, null_draws=99, fnull_draws=0, eig_top=0, null_stride=1) as mon,
        torch.no_grad(),
    ):
        model(**batch)
    df = mon.summary()
    assert df["p_null"].notna().all(), "too few null tokens for a p"
    assert not (df["q_null"] < 0.05).any()
    n = len(df)
    share = float((df["p_null"] < 0.05).mean())
    binom = float((df["p_binom"] < 0.05).mean())
    se = math.sqrt(0.05 * 0.95 / n)
    print(
        f"\n[smollm2 calibration] {n} (target, layer) pairs: p_null < 0.05 in {share:.3f}, p_binom < 0.05 in {binom:.3f}"
    )
    # the 20 targets share tokens, so pairs are not independent: allow 3 binomial SEs plus resolution
    assert share <= 0.05 + 3 * se + 0.02
    assert binom > 2 * share  # the binomial test against 0.5 is anti-conservative here


def test_lens_bridge_equals_hf(smollm2):
    lens = pytest.importorskip("transformer_lens")
    model, tok = smollm2
    try:
        bridge = lens.TransformerBridge.boot_transformers(
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            hf_model=copy.deepcopy(model),  # the bridge takes over its model's modules in place:
            tokenizer=tok,  # a private copy keeps the session's shared SmolLM2 a plain HF model
        )
    except Exception as e:  # noqa: BLE001 - report why the bridge cannot boot offline, not a pass
        pytest.fail(f"TransformerBridge cannot boot SmolLM2 offline: {type(e).__name__}: {e}")
    hf = eh.spectra(model, layers=[0, 29], cache=False)
    tl = eh.spectra(bridge, layers=[0, 29], cache=False)
    for a, b in zip(hf, tl):
        assert abs(a.lambda_1 - b.lambda_1) < 1e-6 * abs(a.lambda_1)
    ids = tok(TEXTS[:1], return_tensors="pt")["input_ids"]
    with eh.monitor(model, targets=[("ov", "modulus")]) as m1, torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    with eh.monitor(bridge, targets=[("ov", "modulus")]) as m2, torch.no_grad():
        bridge(ids)
    d1, d2 = m1.summary(), m2.summary()
    assert (d1["n_tokens"] == d2["n_tokens"]).all()
    assert (d1["gamma_pre"] - d2["gamma_pre"]).abs().max() < 1e-4


def test_main_job_end_to_end(smollm2, tmp_path):
    from eigenhooks.run import run

    res = run("smollm2-135m", max_tokens=512, batch_size=4, out=tmp_path / "run", progress=False)
    df = res.summary
    assert len(df) == 60 and set(df["target"]) == {"ov/modulus", "ov/residual"}
    assert (df["n_tokens"] == 512).all()
    for f in ("summary.csv", "meta.json", "stats.jsonl", "spectra.json", "report.html"):
        assert (res.out / f).exists(), f
    assert df["p_null"].between(0, 1).all() and set(df["verdict_haar"]) <= {"toward", "away", "indistinguishable"}
    # 512 tokens are 4 sequences: the verdict scores half of them against a null estimated on the other half
    assert (df["verdict"] == "too few sequences").all() and (df["verdict_sequences"] == 2).all()
