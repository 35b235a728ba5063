"""Every HF family: F read from the weights equals F from the model's own forward (probe)."""

import pytest
import torch
from harness import FAMILY_CONFIGS, build

import eigenhooks as eh
from eigenhooks.models.probe import apply_attention, probe_matrices
from eigenhooks.spectra import compute

FAMILIES = list(FAMILY_CONFIGS)
EXPECTED = {
    "gpt2": ("gpt2", "pre"),
    "distilgpt2": ("gpt2", "pre"),
    "gpt_neo": ("gpt_neo", "pre"),
    "gpt_neox": ("gpt_neox", "pre"),
    "gptj": ("gptj", "pre"),
    "bert": ("bert", "post"),
    "roberta": ("roberta", "post"),
    "distilbert": ("distilbert", "post"),
    "albert": ("albert", "post"),
    "albert_inner2": ("albert", "post"),
    "llama": ("llama", "pre"),
    "mistral": ("mistral", "pre"),
    "qwen2": ("qwen2", "pre"),
    "opt": ("opt", "pre"),
    "opt_postnorm": ("opt", "post"),
}


@pytest.mark.parametrize("bare", [False, True], ids=["head", "bare"])
@pytest.mark.parametrize("family", FAMILIES)
def test_weights_equal_probe(family, bare):
    model = build(family, bare=bare)
    ad = eh.get_adapter(model)
    assert (ad.family, ad.norm_position) == EXPECTED[family]
    probed = probe_matrices(ad)
    for i in range(ad.n_layers):
        F_w = ad.factors(i).matrix()
        assert F_w.abs().max() > 0.1, "F too small for the comparison to mean anything"
        torch.testing.assert_close(F_w, probed[i], atol=1e-8, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_principal_eigenvector_through_attention_module(family):
    """F v_1 = lambda_1 v_1 with v_1 pushed through the attention module itself."""
    model = build(family)
    for s in eh.spectra(model, cache=False):
        v = s.v_1
        X = torch.stack([v.real, v.imag])  # (2, d): F is real, so F Re v and F Im v suffice
        FX = apply_attention(eh.get_adapter(model), s.layer, X)
        Fv = torch.complex(FX[0], FX[1])
        torch.testing.assert_close(Fv, s.lambda_1 * v, atol=1e-8, rtol=0)


def test_wrong_layout_is_caught():
    """The comparison can fail: reading GPT-2's Conv1D without the transpose is detected."""
    model = build("gpt2")
    ad = eh.get_adapter(model)
    attn = model.transformer.h[0].attn
    d = 16
    ad.layers[0].factors = lambda: eh.Factors.from_stacked(attn.c_proj.weight, attn.c_attn.weight[:, 2 * d :], 2)
    (row0, _) = eh.verify(ad)
    assert row0.max_abs_diff > 1e-2


def test_albert_shared_groups_and_unrolled_layers():
    ad = eh.get_adapter(build("albert"))
    assert ad.n_layers == 4 and ad.shared_groups() == [[0, 1], [2, 3]]
    assert ad.layers[0].attn_out is ad.layers[1].attn_out
    ad2 = eh.get_adapter(build("albert_inner2"))
    assert ad2.n_layers == 4 and ad2.shared_groups() == [[0, 2], [1, 3]]
    specs = eh.spectra(build("albert"), cache=False)
    assert [s.layer for s in specs] == [0, 1, 2, 3]
    assert torch.equal(specs[0].eigenvalues, specs[1].eigenvalues)
    assert not torch.equal(specs[1].eigenvalues, specs[2].eigenvalues)


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert", "albert"])
def test_ov_ln_folds_norm_scale(family):
    model = build(family)
    ad = eh.get_adapter(model)
    for i in range(ad.n_layers):
        F = ad.factors(i).matrix()
        w = torch.diag(ad.norm_weight(i).double())
        expected = F @ w if ad.norm_position == "pre" else w @ F
        got = compute.layer_factors(ad, i, "ov_ln")[0].matrix()
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


def test_reading_points_and_final_norm():
    model = build("gpt2")
    ad = eh.get_adapter(model)
    rp = ad.reading_points(0)
    blk = model.transformer.h[0]
    # read where consumed: pre at ln_1's input, mid at ln_2's input, post at the next block's ln_1
    assert rp.pre.module is blk.ln_1 and rp.pre.where == "input"
    assert rp.mid.module is blk.ln_2 and rp.mid.where == "input" and not rp.mid_is_sum
    assert rp.post.module is model.transformer.h[1].ln_1 and rp.post.where == "input"
    last = ad.reading_points(ad.n_layers - 1)
    assert last.post.module is model.transformer.ln_f and last.post.where == "input"
    assert ad.final_norm() is model.transformer.ln_f
    assert ad.unembedding().shape == (64, 16)
    post = eh.get_adapter(build("bert"))
    rp = post.reading_points(1)
    lyr = post.model.bert.encoder.layer[1]
    assert rp.mid.module is lyr.attention.output.LayerNorm and rp.mid.where == "output" and not rp.mid_is_sum
    assert rp.pre.module is lyr.attention.self and rp.pre.where == "input"
    assert rp.post_norm is lyr.attention.output.LayerNorm


def _doge(layers: int):
    """A tiny float64 Doge (no weight rule: its layers go through the probe), seeded."""
    import transformers as T

    torch.manual_seed(0)
    cfg = T.DogeConfig(
        num_hidden_layers=layers,
        num_attention_heads=2,
        hidden_size=16,
        intermediate_size=32,
        vocab_size=64,
        max_position_embeddings=32,
    )
    return T.DogeForCausalLM(cfg).double().eval()


def test_generic_fallback_uses_probe():
    """A family with no rule (OLMo) goes through the probe; its F matches o_proj @ v_proj."""
    model = _doge(2)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    ad = eh.get_adapter(model)
    assert ad.family.startswith("generic:") and ad.layers[0].factors is None
    specs = eh.spectra(model, cache=False)
    for i, s in enumerate(specs):
        a = model.model.layers[i].self_attn
        F = a.o_proj.weight @ a.v_proj.weight
        ref = layer_spectrum_of(F)
        torch.testing.assert_close(s.eigenvalues, ref.eigenvalues, atol=1e-8, rtol=0)


def layer_spectrum_of(F):
    return eh.layer_spectrum(
        eh.Factors(F[None], torch.eye(F.shape[0], dtype=F.dtype)[None], torch.zeros(1, dtype=torch.long))
    )


def test_probes_of_one_model_side_by_side_do_not_mix():
    """spectra reads layers in a thread pool; a probed layer runs the model's forward with hooks on
    shared modules. Four probes of one model at once, five times over, must each give its own F
    (without the probe lock, 11 of 20 here raised 'attention ... never called' or differed)."""
    from concurrent.futures import ThreadPoolExecutor

    model = _doge(4)
    ad = eh.get_adapter(model)
    ref = {
        i: model.model.layers[i].self_attn.o_proj.weight @ model.model.layers[i].self_attn.v_proj.weight
        for i in range(4)
    }
    for _ in range(5):
        with ThreadPoolExecutor(4) as ex:
            got = list(ex.map(lambda i: probe_matrices(ad, [i])[i], range(4)))
        for i in range(4):
            torch.testing.assert_close(got[i], ref[i].detach(), atol=1e-10, rtol=0)
