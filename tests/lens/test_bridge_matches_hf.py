"""TransformerLens bridge: the same F and spectra as HuggingFace on the same weights."""

import pytest
import torch
from harness import build

import eigenhooks as eh

tl = pytest.importorskip("transformer_lens", reason="TransformerLens not installed (pip install 'eigenhooks[lens]')")
if "TransformerBridge" not in dir(tl):
    pytest.skip(
        "TransformerBridge needs TransformerLens 4 (3.x: tests/lens/test_hooked_transformer.py)",
        allow_module_level=True,
    )


@pytest.fixture(scope="module")
def tokenizer():
    return eh.zoo.load("gpt2-tiny")[1]


def _bridge(model, tokenizer):
    name = model.config.model_type
    return tl.TransformerBridge.boot_transformers(name, hf_model=model, tokenizer=tokenizer, dtype=torch.float64)


def _model(family):
    m = build(family)
    m.resize_token_embeddings(1024)  # the zoo tokenizer's vocabulary
    return m


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_bridge_raw_matches_hf(family, tokenizer):
    hf = _model(family)
    F_hf = [eh.get_adapter(hf).factors(i).matrix() for i in range(2)]
    s_hf = eh.spectra(hf, cache=False, heads=True)
    bridge = _bridge(hf, tokenizer)
    ad = eh.get_adapter(bridge)
    assert ad.family == "lens-bridge" and ad.compatibility_mode is False
    assert "raw mode" in ad.notes[0]
    for i in range(2):
        torch.testing.assert_close(ad.factors(i).matrix(), F_hf[i], atol=1e-12, rtol=0)
    for a, b in zip(s_hf, eh.spectra(bridge, cache=False, heads=True)):
        torch.testing.assert_close(a.eigenvalues, b.eigenvalues, atol=1e-10, rtol=0)
        torch.testing.assert_close(a.basis, b.basis, atol=1e-10, rtol=0)
    # F from the bridge's own forward (hooks on attn.hook_in / attn.hook_out)
    for r in eh.verify(bridge, n_tokens=1):
        assert r.max_abs_diff < 1e-8, r
    # With two tokens the softmax really averages. The bridge computes rotary models'
    # softmax in float32, so the rows sum to 1 only to ~1e-8 there: the probe shows it.
    tol = 1e-8 if family == "gpt2" else 1e-6
    for r in eh.verify(bridge, n_tokens=2):
        assert r.max_abs_diff < tol, r


def test_head_eigenvalues_match_transformer_lens_OV(tokenizer):
    """Per-head eigenvalues against TransformerLens's FactoredMatrix, an independent implementation."""
    bridge = _bridge(_model("gpt2"), tokenizer)
    ov = bridge.OV  # (layers, heads) FactoredMatrix, row convention
    tl_eigs = ov.eigenvalues  # (layers, heads, d_head)
    for s in eh.spectra(bridge, heads=True, cache=False):
        for h in s.heads:
            ours = h.eigenvalues.to(torch.complex128)
            theirs = tl_eigs[s.layer, h.head].to(torch.complex128)
            ours = ours[torch.argsort(ours.abs() * 1e6 + ours.angle())]
            theirs = theirs[torch.argsort(theirs.abs() * 1e6 + theirs.angle())]
            torch.testing.assert_close(ours, theirs, atol=1e-8, rtol=0)


def test_compatibility_mode_difference_is_explained(tokenizer):
    hf = _model("gpt2")
    F = [eh.get_adapter(hf).factors(i).matrix() for i in range(2)]
    w = [hf.transformer.h[i].ln_1.weight.detach().clone() for i in range(2)]
    bridge = _bridge(hf, tokenizer)
    bridge.enable_compatibility_mode(disable_warnings=True)
    ad = eh.get_adapter(bridge)
    assert ad.compatibility_mode is True and "fold_ln" in ad.notes[0]
    d = 16
    P = torch.eye(d, dtype=torch.float64) - 1.0 / d
    for i in range(2):
        expected = P @ F[i] @ torch.diag(w[i]) @ P  # centring on both sides, ln1 folded into V
        got = ad.factors(i).matrix()
        assert (got - F[i]).abs().max() > 1e-2  # it really differs from raw
        # TransformerLens processes weights in float32: agreement to float32 precision
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    for r in eh.verify(bridge, n_tokens=1):
        assert r.max_abs_diff < 1e-8


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_head_vectors_and_readouts_match_hf(family, tokenizer):
    """Per-head and per-group vectors, circuit copying and token readouts of the bridge equal the HF model's."""
    hf = _model(family)
    bridge = _bridge(hf, tokenizer)
    for rank in ("modulus", "residual"):
        for a, b in zip(
            eh.spectra(hf, rank=rank, heads=True, cache=False), eh.spectra(bridge, rank=rank, heads=True, cache=False)
        ):
            for p, q in zip(a.heads + a.groups, b.heads + b.groups):
                assert (p.k, p.kind) == (q.k, q.kind)
                torch.testing.assert_close(p.basis, q.basis, atol=1e-10, rtol=0)
                torch.testing.assert_close(p.eigenvalues, q.eigenvalues, atol=1e-10, rtol=0)
                assert (
                    abs(p.circuit_copying - q.circuit_copying) < 1e-10
                    and abs(p.copying_score - q.copying_score) < 1e-10
                )
    s = eh.spectra(hf, heads=True, cache=False)[1].heads[0]
    for side in ("out", "in"):
        r_hf = eh.read_tokens(hf, tokenizer, s, k=5, side=side, null_draws=20)
        r_tl = eh.read_tokens(bridge, tokenizer, s, k=5, side=side, null_draws=20)
        assert [t for t, _ in r_hf.top] == [t for t, _ in r_tl.top] and r_hf.score == pytest.approx(
            r_tl.score, abs=1e-10
        )
        assert (r_hf.null_lo, r_hf.null_hi) == pytest.approx((r_tl.null_lo, r_tl.null_hi), abs=1e-10)


def test_bridge_gemma_norms_scale_by_one_plus_w(tokenizer):
    """A raw Gemma bridge's ln1 and ln_final scale by 1 + w (issue 52): ov_ln and the readout equal HF's."""
    import transformers as T

    torch.manual_seed(0)
    cfg = T.GemmaConfig(
        vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    hf = T.GemmaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    hf = hf.double().eval()
    want = eh.spectra(hf, variant="ov_ln", cache=False)
    u = torch.randn(32, dtype=torch.float64, generator=g)
    read = eh.read_tokens(hf, tokenizer, u, null_draws=0)
    bridge = _bridge(hf, tokenizer)
    for a, b in zip(want, eh.spectra(bridge, variant="ov_ln", cache=False)):
        torch.testing.assert_close(a.eigenvalues, b.eigenvalues, atol=1e-10, rtol=0)
    got = eh.read_tokens(bridge, tokenizer, u, null_draws=0)
    assert [t for t, _ in got.top] == [t for t, _ in read.top]
    torch.testing.assert_close(
        torch.tensor([s for _, s in got.top]), torch.tensor([s for _, s in read.top]), atol=1e-6, rtol=0
    )
