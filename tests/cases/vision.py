"""Vision and multimodal cases (eigenhooks/models/vision.py).

Images are 8x8 with 4x4 patches: 4 patches + CLS = 5 tokens per image. A vision tower has
no attention mask, so the padded check counts every token (``extra["tokens"]``); CLIPModel's
text tower counts the attention mask's tokens and its vision tower every token.
"""

import torch
import transformers as T
from harness import Case, seeded, sum_mid, token_inputs

B, TOKENS = 2, 5  # images per batch, tokens per image
VISION = dict(
    num_hidden_layers=2,
    num_attention_heads=2,
    hidden_size=16,
    intermediate_size=32,
    image_size=8,
    patch_size=4,
    num_channels=3,
)
TEXT = dict(
    num_hidden_layers=2,
    num_attention_heads=2,
    hidden_size=16,
    intermediate_size=32,
    vocab_size=64,
    max_position_embeddings=16,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
TOK = token_inputs()


def pixels(seed: int = 1) -> torch.Tensor:
    """A seeded image batch (B, 3, 8, 8)."""
    return torch.randn(B, 3, 8, 8, generator=torch.Generator().manual_seed(seed))


def image_inputs(model, padded: bool) -> dict:
    """pixel_values only: there is no padding to add (no attention mask, every token counts)."""
    return {"pixel_values": pixels()}


def clip_inputs(model, padded: bool) -> dict:
    """Token ids with the text attention mask (row 0 left-padded when padded) and pixel_values."""
    return {**TOK(model, padded), "pixel_values": pixels()}


def _calibrate_images(model) -> dict:
    return {"pixel_values": pixels(seed=2)}


def _calibrate_both(model) -> dict:
    return {**TOK(model, False), "pixel_values": pixels(seed=2)}


def _clip_layers(tower):
    return lambda m: tower(m).encoder.layers


VIT_MID = sum_mid(lambda m: m.base_model.layers, lambda b: b.attention)
CLIP_TEXT_MID = sum_mid(_clip_layers(lambda m: m), lambda b: b.self_attn)
CLIP_MID = sum_mid(
    lambda m: [*m.vision_model.encoder.layers, *m.text_model.encoder.layers],  # forward order: vision first
    lambda b: b.self_attn,
)
IMAGES = {"tokens": {"": B * TOKENS}, "calibration": _calibrate_images}

CASES = {
    "vit": Case(
        seeded(lambda: T.ViTForImageClassification(T.ViTConfig(**VISION, num_labels=3, initializer_range=0.2))),
        "vit",
        VIT_MID,
        image_inputs,
        extra=IMAGES,
    ),
    "clip (text)": Case(
        seeded(lambda: T.CLIPTextModel(T.CLIPTextConfig(**TEXT))),
        "clip_text_model",
        CLIP_TEXT_MID,
        TOK,
        extra={"calibration": lambda m: TOK(m, True)},  # no LM head to sample text from
    ),
    "clip (vision)": Case(
        seeded(lambda: T.CLIPVisionModel(T.CLIPVisionConfig(**VISION))),
        "clip_vision_model",
        CLIP_TEXT_MID,
        image_inputs,
        extra=IMAGES,
    ),
    "clip (both towers)": Case(
        seeded(lambda: T.CLIPModel(T.CLIPConfig(text_config=TEXT, vision_config=VISION, projection_dim=8))),
        "clip",
        CLIP_MID,
        clip_inputs,
        stacks=("vision", "text"),
        extra={"tokens": {"vision": B * TOKENS}, "calibration": _calibrate_both},
    ),
}
