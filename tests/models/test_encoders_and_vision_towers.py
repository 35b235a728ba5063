"""Encoders and vision towers beyond the shared check list: F read by the test itself from the raw
state_dict, the layouts' error paths, and steering/monitoring where there are no token ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as T
from cases import CASES
from cases.vision import TEXT, VISION, pixels

import eigenhooks as eh
from eigenhooks.models.base import UnsupportedModelError
from eigenhooks.models.probe import probe_matrices
from eigenhooks.models.vision import pixel_inputs


def _rows(block: slice | None = None):
    """Rows of the V weight: all, or a block (a fused qkv)."""
    return lambda W: W if block is None else W[block]


# name -> [(V key, rows of V, O key)] per layer, in forward order, written from the modeling files
D = 16
RAW = {
    "electra": [
        (
            f"electra.encoder.layer.{i}.attention.self.value.weight",
            None,
            f"electra.encoder.layer.{i}.attention.output.dense.weight",
        )
        for i in range(2)
    ],
    "deberta-v2": [
        (
            f"deberta.encoder.layer.{i}.attention.self.value_proj.weight",
            None,
            f"deberta.encoder.layer.{i}.attention.output.dense.weight",
        )
        for i in range(2)
    ],
    # ModernBertAttention: qkv.view(..., 3, H, d_head).unbind(-3): V is output rows [2d, 3d)
    "modernbert": [
        (f"model.layers.{i}.attn.Wqkv.weight", slice(2 * D, 3 * D), f"model.layers.{i}.attn.Wo.weight")
        for i in range(2)
    ],
    "vit": [
        (f"vit.layers.{i}.attention.v_proj.weight", None, f"vit.layers.{i}.attention.o_proj.weight") for i in range(2)
    ],
    "clip (text)": [
        (f"encoder.layers.{i}.self_attn.v_proj.weight", None, f"encoder.layers.{i}.self_attn.out_proj.weight")
        for i in range(2)
    ],
    "clip (vision)": [
        (f"encoder.layers.{i}.self_attn.v_proj.weight", None, f"encoder.layers.{i}.self_attn.out_proj.weight")
        for i in range(2)
    ],
    "clip (both towers)": [
        (
            f"{t}_model.encoder.layers.{i}.self_attn.v_proj.weight",
            None,
            f"{t}_model.encoder.layers.{i}.self_attn.out_proj.weight",
        )
        for t in ("vision", "text")  # CLIPModel.forward runs the vision tower first
        for i in range(2)
    ],
}


def _raw_F(sd: dict, v_key: str, rows: slice | None, o_key: str) -> np.ndarray:
    """F = W_O W_V (d, d) in float64 numpy, from the raw (out, in) tensors."""
    V = sd[v_key].detach().numpy().astype(np.float64)
    V = V if rows is None else V[rows]
    return sd[o_key].detach().numpy().astype(np.float64) @ V


@pytest.mark.parametrize("name", sorted(RAW))
def test_F_equals_the_raw_state_dict(name):
    model = CASES[name].build()
    ad, sd = eh.get_adapter(model), model.state_dict()
    assert ad.n_layers == len(RAW[name])
    for i, (vk, rows, ok) in enumerate(RAW[name]):
        ref = _raw_F(sd, vk, rows, ok)
        got = ad.factors(i).matrix().numpy()
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-12 * np.abs(ref).max(), err_msg=f"layer {i}")


def test_modernbert_raw_check_tells_the_value_block_from_the_key_block():
    model = CASES["modernbert"].build()
    ad, sd = eh.get_adapter(model), model.state_dict()
    k_block = _raw_F(sd, "model.layers.0.attn.Wqkv.weight", slice(D, 2 * D), "model.layers.0.attn.Wo.weight")
    assert np.abs(ad.factors(0).matrix().numpy() - k_block).max() > 1e-3 * np.abs(k_block).max()


def test_modernbert_layer0_identity_norm():
    model = CASES["modernbert"].build()
    ad = eh.get_adapter(model)
    assert isinstance(ad.layers[0].norm, torch.nn.Identity) and ad.norm_weight(0) is None
    assert ad.norm_weight(1) is not None
    ov, ov_ln = eh.spectra(model, "ov", cache=False), eh.spectra(model, "ov_ln", cache=False)
    assert ov[0].lambda_1 == pytest.approx(ov_ln[0].lambda_1, rel=1e-12)


def test_deberta_relative_positions_change_the_scores_not_F():
    model = CASES["deberta-v2"].build()
    ids = torch.randint(3, 64, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before_out = model(input_ids=ids).logits
        before_F = probe_matrices(eh.get_adapter(model))
        model.deberta.encoder.rel_embeddings.weight.mul_(3.0).add_(0.5)
        after_out = model(input_ids=ids).logits
        after_F = probe_matrices(eh.get_adapter(model))
    assert (after_out - before_out).abs().max() > 1e-3  # the relative terms are live in this model
    for i in before_F:
        torch.testing.assert_close(after_F[i], before_F[i], rtol=0, atol=1e-7)


def test_a_layout_mismatch_names_what_was_found():
    model = CASES["vit"].build()
    del model.vit.layers[1].attention.v_proj
    with pytest.raises(UnsupportedModelError, match=r"expected a submodule 'v_proj'.*children: q_proj, k_proj, o_proj"):
        eh.get_adapter(model)


@pytest.fixture(scope="module")
def wide_clip():
    """CLIPModel whose towers differ in width, as real CLIPs do (text 16, vision 24)."""
    vision = dict(VISION, hidden_size=24, intermediate_size=48, num_attention_heads=3)
    torch.manual_seed(0)
    return T.CLIPModel(T.CLIPConfig(text_config=TEXT, vision_config=vision, projection_dim=8)).eval()


def test_clip_towers_of_different_widths_each_have_their_F(wide_clip):
    ad = eh.get_adapter(wide_clip)
    assert [ad.width(i) for i in range(4)] == [24, 24, 16, 16] and ad.d_model == 16
    probed = probe_matrices(ad)
    for i in range(4):
        F = ad.factors(i).matrix()
        assert F.shape == probed[i].shape == (ad.width(i), ad.width(i))
        assert float((F - probed[i]).abs().max()) <= 1e-5 * float(F.abs().max()), i
    rows = eh.verify(wide_clip)
    assert all(r.check == "weights" and r.linear and r.max_abs_diff <= 1e-5 * r.max_abs_F for r in rows)


def test_monitor_and_steer_on_towers_of_different_widths(wide_clip):
    inputs = CASES["clip (both towers)"].inputs(wide_clip, True)
    g = torch.Generator().manual_seed(0)
    u0, u3 = torch.randn(24, generator=g, dtype=torch.float64), torch.randn(16, generator=g, dtype=torch.float64)
    targets = [("ov", "modulus"), ("mine", {0: u0 / u0.norm(), 3: u3 / u3.norm()})]  # one per tower's width
    with eh.monitor(wide_clip, targets=targets, null_draws=16, fnull_draws=0, eig_top=0) as mon:
        with torch.no_grad():
            wide_clip(**inputs)
    df = mon.summary().reset_index()
    ov = df[df["target"] == "ov/modulus"]
    assert list(ov["n_tokens"]) == [10, 10, 11, 11] and ov["rho"].notna().all()
    before = {k: v.clone() for k, v in wide_clip.state_dict().items()}
    with eh.steer(wide_clip, torch.ones(24, dtype=torch.float64) / 24**0.5, layer=1, calibration=inputs) as s:
        with torch.no_grad():
            wide_clip(**inputs)
        rep = s.summary()
    assert abs(rep.cos_v1_u) > 0.999 and rep.alignment_after > rep.alignment_before  # read on the vision tower
    assert all(torch.equal(before[k], v) for k, v in wide_clip.state_dict().items())
    with pytest.raises(ValueError, match="16"):
        eh.steer(wide_clip, torch.ones(24, dtype=torch.float64), layer=-1, calibration=inputs)


def test_probe_pixels_need_an_image_size():
    model = CASES["vit"].build()
    model.config.image_size = [8, 8, 8]  # the config accepts any list of ints
    with pytest.raises(UnsupportedModelError, match=r"image_size=\[8, 8, 8\].*\(height, width\)"):
        pixel_inputs(model, 1, 2, torch.device("cpu"))


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("vit", r"input embedding is ViTPatchEmbeddings.*pixel_values"),
        ("clip (vision)", r"input embedding is Conv2d.*pixel_values"),
        ("clip (both towers)", r"input embedding is NoneType.*pixel_values"),
        ("clip (text)", r"CLIPTextModel has no LM head"),
    ],
)
def test_steer_without_calibration_says_what_to_pass(name, match):
    model = CASES[name].build()
    u = torch.ones(16, dtype=torch.float64) / 4
    with pytest.raises(UnsupportedModelError, match=match):
        eh.steer(model, u)


def test_steer_report_on_a_vision_tower_has_no_token_probability():
    model = CASES["vit"].build()
    u = torch.ones(16, dtype=torch.float64) / 4
    with eh.steer(model, u, calibration={"pixel_values": pixels(2)}) as s:
        with torch.no_grad():
            model(pixel_values=pixels())
        rep = s.summary(target_token=0)
    assert rep.prob_before is None and rep.prob_after is None
    assert rep.alignment_after > rep.alignment_before and abs(rep.cos_v1_u) > 0.999


def test_steer_a_vision_layer_of_clipmodel_ignores_the_text_mask():
    model = CASES["clip (both towers)"].build()
    ad = eh.get_adapter(model)
    assert [ly.stack for ly in ad.layers] == ["vision", "vision", "text", "text"]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cal = CASES["clip (both towers)"].inputs(model, True)  # a text mask of shape (2, 7), vision has 5 tokens
    u = torch.ones(16, dtype=torch.float64) / 4
    with eh.steer(model, u, layer=1, calibration=cal) as s:
        with torch.no_grad():
            model(**cal)
        rep = s.summary(target_token=0)
    assert abs(rep.cos_v1_u) > 0.999 and rep.prob_after is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_monitor_on_clipmodel_counts_each_tower_by_its_own_rule():
    model = CASES["clip (both towers)"].build()
    inputs = CASES["clip (both towers)"].inputs(model, True)
    with eh.monitor(model, targets=[("ov", "modulus")], null_draws=16, fnull_draws=0, eig_top=0) as mon:
        with torch.no_grad():
            model(**inputs)
            model(**inputs)
    df = mon.summary()
    assert list(df["n_tokens"]) == [20, 20, 22, 22]  # vision: 2 x 2 x 5; text: 2 x (4 + 7)
    assert df["rho"].notna().all()


@pytest.mark.parametrize("name", ["vit", "clip (vision)"])
def test_iterate_a_vision_tower_from_pixel_values(name):
    from harness import record

    model = CASES[name].build()
    blk = eh.get_adapter(model).layers[0].block
    px = {"pixel_values": pixels()[:1]}
    with record([blk]) as got, torch.no_grad():
        model(**px)
    y = got[id(blk)][0][1][0].double()  # (5, d) the block's own output on these pixels
    traj = eh.iterate(model, px, layer=0, steps=1)
    torch.testing.assert_close(traj.final, y / y.norm(dim=-1, keepdim=True), rtol=1e-5, atol=1e-6)
    start = torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(0))  # hidden states, no image
    assert len(eh.iterate(model, start, layer=1, steps=3).alignment) == 4
