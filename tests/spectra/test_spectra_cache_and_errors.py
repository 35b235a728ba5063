"""spectra(): cache, dtypes, and the errors a user can trigger."""

import os
import re

import numpy as np
import pytest
import torch
from harness import build

import eigenhooks as eh
from eigenhooks.spectra import compute


def test_cache_hit_skips_computation(monkeypatch):
    model = build("gpt2")
    first = eh.spectra(model, heads=True)
    files = os.listdir(os.environ["EIGENHOOKS_CACHE"])
    assert files and all(f.endswith(".safetensors") for f in files)

    def boom(*a, **k):
        raise AssertionError("recomputed despite a cache hit")

    monkeypatch.setattr(compute, "layer_spectra", boom)
    compute.clear_memo()  # the disk cache is what is tested here, not the in-process memo
    second = eh.spectra(model, heads=True)
    for a, b in zip(first, second):
        assert torch.equal(a.eigenvalues, b.eigenvalues) and torch.equal(a.basis, b.basis)
        assert (a.kind, a.k, a.gap_ratio, a.lambda_next) == (b.kind, b.k, b.gap_ratio, b.lambda_next)
        assert [h.copying_score for h in a.heads] == [h.copying_score for h in b.heads]


def test_cache_key_follows_weights_and_options():
    model = build("gpt2")
    a = eh.spectra(model)
    with torch.no_grad():
        model.transformer.h[0].attn.c_proj.weight.mul_(2.0)
    b = eh.spectra(model)
    torch.testing.assert_close(b[0].eigenvalues, 2 * a[0].eigenvalues)
    assert torch.equal(a[1].eigenvalues, b[1].eigenvalues)
    r = eh.spectra(model, rank="residual")
    assert r[0].rank == "residual"


def test_corrupt_cache_entry_is_recomputed(monkeypatch):
    model = build("gpt2")
    eh.spectra(model)
    folder = os.environ["EIGENHOOKS_CACHE"]
    for f in os.listdir(folder):
        with open(os.path.join(folder, f), "wb") as fh:
            fh.write(b"not a safetensors file")
    compute.clear_memo()
    again = eh.spectra(model)
    assert len(again) == 2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_models(dtype):
    ref = eh.spectra(build("llama"), cache=False)
    low = eh.spectra(build("llama", dtype=dtype), cache=False)
    for a, b in zip(ref, low):
        assert a.eigenvalues.dtype == b.eigenvalues.dtype == torch.complex128
        tol = 5e-2 if dtype != torch.float32 else 1e-5
        assert abs(a.lambda_1 - b.lambda_1) < tol * abs(a.lambda_1)
    rows = eh.verify(build("gpt2", dtype=dtype))
    assert all(r.rel_diff < (2e-2 if dtype != torch.float32 else 1e-5) for r in rows)


def test_meta_device_model_is_rejected():
    import transformers as T

    with torch.device("meta"):
        model = T.GPT2LMHeadModel(T.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64))
    with pytest.raises(ValueError, match="meta device"):
        eh.spectra(model)


def test_non_finite_weight_is_named():
    model = build("gpt2")
    with torch.no_grad():
        model.transformer.h[1].attn.c_proj.weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"layer 1 .*non-finite values in O"):
        eh.spectra(model, cache=False)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_verify_refuses_a_non_finite_weight_as_spectra_does(family, value):
    """Issue 41: verify returned a NaN row with linear=False; docs/api.md promises a ValueError."""
    model = build(family)
    attn = model.transformer.h[1].attn if family == "gpt2" else model.model.layers[1].self_attn
    weight = attn.c_proj.weight if family == "gpt2" else attn.v_proj.weight
    with torch.no_grad():
        weight[2, 3] = value
    where = "O" if family == "gpt2" else "V"
    with pytest.raises(ValueError, match=rf"layer 1 .*non-finite values in {where} weights"):
        eh.verify(model)
    with pytest.raises(ValueError, match=rf"layer 1 .*non-finite values in {where} weights"):
        eh.spectra(model, cache=False)


def test_verify_refuses_a_probe_that_is_not_finite():
    """A NaN outside O and V that reaches F (here the value bias, through every token's value)."""
    model = build("gpt2")
    d = model.config.n_embd
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.bias[2 * d + 1] = float("nan")
    with pytest.raises(ValueError, match=r"layer 0 .*probe's F holds inf or NaN"):
        eh.verify(model, layers=[0])


def test_unsupported_model_names_families():
    with pytest.raises(eh.UnsupportedModelError, match="gpt2.*llama"):
        eh.spectra(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(eh.UnsupportedModelError, match="Supported"):
        eh.get_adapter("gpt2")


def test_bad_variant_rank_and_layer():
    model = build("gpt2")
    with pytest.raises(ValueError, match="variant must be one of"):
        eh.spectra(model, variant="qk")
    with pytest.raises(ValueError, match="rank must be one of"):
        eh.spectra(model, rank="largest")
    with pytest.raises(IndexError, match="out of range"):
        eh.spectra(model, layers=[5])


@pytest.mark.parametrize("top", [0, -1, 1.5, True, "3"])
def test_top_below_one_is_refused_naming_it(top):
    """Issue 41: top=0 or -1 raised torch's 'stack expects a non-empty TensorList'."""
    with pytest.raises(ValueError, match=rf"top must be an integer >= 1 .*got {re.escape(repr(top))}"):
        eh.spectra(build("gpt2"), top=top)


@pytest.mark.parametrize("threshold", [2.0, float("nan"), -0.5, 0.0, float("inf"), "0.5", None])
def test_threshold_outside_zero_one_is_refused_naming_it(threshold):
    """Issue 41: 2.0, nan and -0.5 were taken; a negative one labelled every layer near-degenerate."""
    with pytest.raises(ValueError, match=r"threshold must be a gap ratio with 0 < threshold <= 1 .*got"):
        eh.spectra(build("gpt2"), threshold=threshold)


def test_top_and_threshold_take_numpy_and_torch_numbers():
    model = build("gpt2")
    want = eh.spectra(model, top=2, threshold=1.0, cache=False)
    got = eh.spectra(model, top=np.int64(2), threshold=np.float32(1.0), cache=False)
    got_t = eh.spectra(model, top=torch.tensor(2), threshold=1, cache=False)
    for a, b, c in zip(want, got, got_t, strict=True):
        assert torch.equal(a.eigenvectors, b.eigenvectors) and torch.equal(a.eigenvectors, c.eigenvectors)
        assert a.kind == b.kind == c.kind


def test_unknown_zoo_name():
    with pytest.raises(KeyError, match="no zoo model named 'gpt5-tiny'"):
        eh.zoo.load("gpt5-tiny")


@pytest.mark.parametrize("layers, inline", [([1], True), (None, False)])
def test_one_layer_runs_inline(monkeypatch, layers, inline):
    # LAPACK's eigvals is slower in a worker thread: a single job must run in the caller's.
    import threading

    model = build("gpt2")
    seen = []
    real = compute.layer_spectra

    def spy(*a, **k):
        seen.append(threading.current_thread() is threading.main_thread())
        return real(*a, **k)

    monkeypatch.setattr(compute, "layer_spectra", spy)
    monkeypatch.setattr(compute, "_cores", lambda: 2)
    specs = eh.spectra(model, layers=layers, cache=False)
    assert seen and all(s == inline for s in seen), seen
    ref = [eh.layer_spectrum(compute.layer_factors(eh.get_adapter(model), s.layer)[0]) for s in specs]
    for a, b in zip(specs, ref):
        assert torch.equal(a.eigenvalues, b.eigenvalues)


def test_inline_job_error_propagates(monkeypatch):
    model = build("gpt2")

    def boom(*a, **k):
        raise RuntimeError("eig failed")

    monkeypatch.setattr(compute, "layer_spectra", boom)
    with pytest.raises(RuntimeError, match="eig failed"):
        eh.spectra(model, layers=[0], cache=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_ov_ln_folds_the_norm_in_float64_whatever_the_dtype(dtype, family):
    """ov_ln of a low-precision model is the float64 eig of its stored weights, not of a bf16 w * V (issue 52)."""
    if family == "gemma":  # a norm of scale 1 + w: the offset is added in float64 too
        import transformers as T

        torch.manual_seed(0)
        cfg = T.GemmaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8,
        )  # fmt: skip
        model = T.GemmaForCausalLM(cfg)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.3)
        model = model.to(dtype).eval()
    else:
        model = build(family, dtype=dtype)
    for s in eh.spectra(model, variant="ov_ln", cache=False):
        blk = (model.model if hasattr(model, "model") else model).layers[s.layer]
        a = blk.self_attn
        O = a.o_proj.weight.detach().double().numpy()  # (d, H dh)
        V = a.v_proj.weight.detach().double().numpy()  # (G dh, d)
        H, G = model.config.num_attention_heads, model.config.num_key_value_heads
        dh = O.shape[1] // H
        V_full = np.concatenate([V[(h // (H // G)) * dh : (h // (H // G) + 1) * dh] for h in range(H)])
        w = blk.input_layernorm.weight.detach().double().numpy() + (1.0 if family == "gemma" else 0.0)
        lam = np.linalg.eigvals(O @ V_full @ np.diag(w))
        ref = lam[np.argmax(np.abs(lam))]
        assert abs(s.lambda_1 - ref) < 1e-12 * abs(ref), (s.lambda_1, ref)
