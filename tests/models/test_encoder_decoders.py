"""Encoder-decoders beyond the shared check list: F from the raw state_dict, every reading point
through the monitor, decoder-only forwards, encoder-only models, and the errors.

The cases (seeded tiny T5, BART, mBART, Whisper) are those of tests/cases/seq2seq.py.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import transformers as T
from cases.seq2seq import CASES, T5CFG, WHISPER, text_inputs, whisper_inputs
from harness import record, seeded

import eigenhooks as eh
from eigenhooks.models.base import UnsupportedModelError
from eigenhooks.models.probe import probe_matrices
from eigenhooks.monitor import stats

NAMES = sorted(CASES)
KW = dict(targets=[("ov", "modulus")], null_draws=16, fnull_draws=0, eig_top=0)


@pytest.fixture(scope="module")
def models():
    return {n: CASES[n].build() for n in NAMES}


def _raw_rows(name: str, cfg) -> list[tuple[str, str, str]]:
    """(stack, kind, key prefix of the attention) per row, in forward order, from the modeling files' names."""
    if CASES[name].extra["layout"] == "t5":
        enc = [("encoder", "self", f"encoder.block.{k}.layer.0.SelfAttention") for k in range(cfg.num_layers)]
        dec = []
        for k in range(cfg.num_decoder_layers):
            dec += [
                ("decoder", "self", f"decoder.block.{k}.layer.0.SelfAttention"),
                ("decoder", "cross", f"decoder.block.{k}.layer.1.EncDecAttention"),
            ]
        return enc + dec
    enc = [("encoder", "self", f"model.encoder.layers.{k}.self_attn") for k in range(cfg.encoder_layers)]
    dec = []
    for k in range(cfg.decoder_layers):
        dec += [
            ("decoder", "self", f"model.decoder.layers.{k}.self_attn"),
            ("decoder", "cross", f"model.decoder.layers.{k}.encoder_attn"),
        ]
    return enc + dec


@pytest.mark.parametrize("name", NAMES)
def test_F_equals_numpy_from_state_dict(name, models):
    """F = O V = sum_h O_h V_h from the raw tensors, in numpy: (d, H d_head) @ (H d_head, d)."""
    model = models[name]
    ad = eh.get_adapter(model)
    sd = {k: v.detach().double().numpy() for k, v in model.state_dict().items()}
    rows = _raw_rows(name, model.config)
    assert [(ly.stack, ly.kind) for ly in ad.layers] == [r[:2] for r in rows]
    v, o = ("v", "o") if CASES[name].extra["layout"] == "t5" else ("v_proj", "out_proj")
    for i, (_, _, key) in enumerate(rows):
        V, O = sd[f"{key}.{v}.weight"], sd[f"{key}.{o}.weight"]  # (H d_head, d), (d, H d_head)
        F = O @ V
        heads = sum(O[:, h * 4 : (h + 1) * 4] @ V[h * 4 : (h + 1) * 4] for h in range(V.shape[0] // 4))
        np.testing.assert_allclose(F, heads, rtol=1e-12, atol=1e-12)  # d_head = 4 in every case
        np.testing.assert_allclose(ad.factors(i).matrix().numpy(), F, rtol=1e-10, atol=1e-12, err_msg=f"row {i}")


def _reference(name: str, model, inputs: dict) -> dict[str, dict[int, torch.Tensor]]:
    """pre, mid and post of every row from the test's own hooks on the model's modules.

    post: the output of the row's layer (both rows of a decoder layer read it after the whole layer).
    """
    base, layout = model.base_model, CASES[name].extra["layout"]
    if layout == "t5":
        enc, dec = list(base.encoder.block), list(base.decoder.block)
        first = lambda b, j: b.layer[j]  # noqa: E731  (a T5 sublayer's input is the residual)
    else:
        enc, dec = list(base.encoder.layers), list(base.decoder.layers)
        post_norm = layout == "post"
        names = ("self_attn", "encoder_attn") if post_norm else ("self_attn_layer_norm", "encoder_attn_layer_norm")
        first = lambda b, j: getattr(b, names[j])  # noqa: E731
    owners = enc + [b for b in dec for _ in (0, 1)]
    firsts = [first(b, 0) for b in enc] + [first(b, j) for b in dec for j in (0, 1)]
    with record(owners + firsts) as got, torch.no_grad():
        model(**inputs)
    pre = {i: got[id(f)][0][0] for i, f in enumerate(firsts)}
    post = {i: got[id(b)][0][1] for i, b in enumerate(owners)}
    with torch.no_grad():
        mids = CASES[name].mid(model, inputs)
    return {"pre": pre, "mid": mids, "post": post}


@pytest.mark.parametrize("name", NAMES)
def test_monitor_reads_every_point_of_every_row(name, models):
    """The monitor's per-token alignments at pre, mid and post equal a(x) of the states the model formed."""
    model, case = models[name], CASES[name]
    inputs = case.inputs(model, True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", eh.MeasurementWarning)
        with eh.monitor(model, tokens=True, **KW) as mon, torch.no_grad():
            model(**inputs)
    ref = _reference(name, model, inputs)
    specs = eh.spectra(model)
    recs = {r["layer"]: r for r in mon.token_records}
    assert sorted(recs) == list(range(mon.adapter.n_layers))
    for i, rec in recs.items():
        U = specs[i].basis.to(torch.float32)
        for p in ("pre", "mid", "post"):
            want = stats.alignment(ref[p][i].float(), U)
            torch.testing.assert_close(rec[f"a_{p}"], want, atol=1e-5, rtol=1e-5, msg=f"layer {i} {p}")


@pytest.mark.parametrize("name", NAMES)
def test_decoder_only_forward_expects_only_the_decoder(name, models):
    """A forward given encoder_outputs runs the decoder alone: no warning, the encoder layers count nothing."""
    model, case = models[name], CASES[name]
    inputs = case.inputs(model, True)
    with torch.no_grad():
        enc = model.get_encoder()(**{k: v for k, v in inputs.items() if not k.startswith("decoder")})
    dec_inputs = {k: v for k, v in inputs.items() if k.startswith("decoder") or k == "attention_mask"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", eh.MeasurementWarning)
        with eh.monitor(model, **KW) as mon, torch.no_grad():
            model(encoder_outputs=enc, **dec_inputs)
    df = mon.summary()
    stack = {ly.index: ly.stack for ly in mon.adapter.layers}
    want = {"encoder": 0, "decoder": int(inputs["decoder_attention_mask"].sum())}
    assert {int(i): int(n) for i, n in zip(df["layer"], df["n_tokens"])} == {i: want[s] for i, s in stack.items()}


class _Bypass(torch.nn.Module):
    """Calls a module's forward without its hooks (the module itself is not registered as a child)."""

    def __init__(self, inner):
        super().__init__()
        self._inner = [inner]

    def forward(self, *args, **kwargs):
        return self._inner[0].forward(*args, **kwargs)


def test_missing_decoder_layer_still_warns(models):
    """Per-stack liveness does not hide a decoder layer whose hooks did not fire."""
    model = models["mbart"]
    inputs = text_inputs(model, False)
    blk = model.base_model.decoder.layers[1]
    real = blk.encoder_attn_layer_norm  # the cross row's pre tap
    with eh.monitor(model, **KW) as mon:
        blk.encoder_attn_layer_norm = _Bypass(real)  # another tool swapped the module: its hooks do not fire
        try:
            with pytest.warns(eh.MeasurementWarning, match=r"layers \[5\] were not measured"), torch.no_grad():
                model(**inputs)
        finally:
            blk.encoder_attn_layer_norm = real
    assert mon.summary()["n_tokens"].iloc[5] == 0


def test_t5_encoder_model():
    """T5EncoderModel: the encoder rows alone, probe inputs without decoder ids."""
    model = seeded(lambda: T.T5EncoderModel(T.T5Config(**T5CFG)))()
    ad = eh.get_adapter(model)
    assert [ly.stack for ly in ad.layers] == ["encoder", "encoder"]
    probed = probe_matrices(ad)
    for i in range(ad.n_layers):
        F = ad.factors(i).matrix()
        assert float((F - probed[i]).abs().max() / F.abs().max()) < 1e-5
    ids = text_inputs(model, True)
    with eh.monitor(model, **KW) as mon, torch.no_grad():
        model(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"])
    assert (mon.summary()["n_tokens"] == int(ids["attention_mask"].sum())).all()


def test_whisper_without_encoder_cannot_be_probed():
    """WhisperForCausalLM has no encoder: its probe cannot build input_features and says so."""
    model = seeded(lambda: T.WhisperForCausalLM(T.WhisperConfig(**WHISPER)))()
    ad = eh.get_adapter(model)
    assert ad.layers and all(ly.stack == "decoder" for ly in ad.layers)
    with pytest.raises(UnsupportedModelError, match="whisper: WhisperForCausalLM has no encoder"):
        probe_matrices(ad)


def test_whisper_probe_stretches_to_the_frames(models):
    """The probe fills Whisper's fixed frame count: input_features (b, n_mels, 2 * max_source_positions)."""
    model = models["whisper"]
    kw = eh.get_adapter(model).probe_inputs(model, 3, 2, torch.device("cpu"))
    assert kw["input_features"].shape == (3, WHISPER["num_mel_bins"], 2 * WHISPER["max_source_positions"])
    assert kw["decoder_input_ids"].shape == (3, 2)
    assert whisper_inputs(model, False)["input_features"].shape[-1] == kw["input_features"].shape[-1]


def test_notes_say_what_cross_alignment_means(models):
    for name in NAMES:
        notes = " ".join(eh.get_adapter(models[name]).notes)
        assert "cross-attention rows" in notes and "no power-step reading" in notes


@pytest.mark.parametrize(
    "name, layer, match",
    [
        ("t5", 3, r"layer 3 \(decoder.block.0.layer.1.EncDecAttention\) is a cross-attention"),
        ("bart (post-norm)", 2, r"in the 'decoder' stack of an encoder-decoder"),
        ("whisper", 0, r"WhisperForConditionalGeneration's encoder takes 'input_features'"),
    ],
)
def test_iterate_refuses_what_it_cannot_run(name, layer, match, models):
    model = models[name]
    with pytest.raises(UnsupportedModelError, match=match):
        eh.iterate(model, text_inputs(model, False)["input_ids"], layer=layer, steps=2)


def test_iterate_runs_an_encoder_layer(models):
    model = models["t5"]
    traj = eh.iterate(model, text_inputs(model, False)["input_ids"], layer=1, steps=3)
    assert traj.layer == 1


@pytest.mark.parametrize(
    "build",
    [
        lambda: T.LongT5ForConditionalGeneration(
            T.LongT5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
        ),
        lambda: T.SwitchTransformersForConditionalGeneration(
            T.SwitchTransformersConfig(
                vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=2, num_experts=2
            )
        ),
    ],
    ids=["longt5", "switch_transformers"],
)
def test_other_t5_variants_get_a_clear_error(build):
    """T5 relatives without a rule (LongT5's local/transient-global attention, Switch's MoE) say so."""
    model = seeded(build)()
    with pytest.raises(UnsupportedModelError, match=f"cannot find the attention layers of {type(model).__name__}"):
        eh.get_adapter(model)


@pytest.mark.parametrize("name", ["t5", "bart (post-norm)", "whisper"])
def test_float64_weights_equal_probe(name):
    """In float64 the weight rule and the model's forward agree to rounding (1e-8 relative)."""
    model = CASES[name].build().double()
    ad = eh.get_adapter(model)
    probed = probe_matrices(ad)
    for i in range(ad.n_layers):
        F = ad.factors(i).matrix()
        assert float((F - probed[i]).abs().max() / F.abs().max()) < 1e-8, i


@pytest.mark.parametrize("name", ["t5", "bart (post-norm)"])
def test_generate_padded_batch_counts_per_stack(name, models):
    """generate on a left-padded batch of 2: the encoder counts its mask once, the decoder every fed token."""
    model = models[name]
    inputs = text_inputs(model, True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", eh.MeasurementWarning)
        with eh.monitor(model, **KW) as mon, torch.no_grad():
            seq = model.generate(
                input_ids=inputs["input_ids"],
                attention_mask=inputs["attention_mask"],
                max_new_tokens=3,
                min_new_tokens=3,
                do_sample=False,
            )
    df = mon.summary()
    want = {"encoder": int(inputs["attention_mask"].sum()), "decoder": 2 * (seq.shape[1] - 1)}
    stack = {ly.index: ly.stack for ly in mon.adapter.layers}
    assert {int(i): int(n) for i, n in zip(df["layer"], df["n_tokens"])} == {i: want[s] for i, s in stack.items()}
    assert (df["n_sequences"] == 2).all()
