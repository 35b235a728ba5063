"""The bundled tokenizers read the same under transformers 4.x and 5.x.

transformers 5 writes ``"tokenizer_class": "TokenizersBackend"``, a name 4.x does not know ("Tokenizer
class TokenizersBackend does not exist"). The zoo names ``PreTrainedTokenizerFast``, which both
majors resolve; CI's floors and lens-3 environments run these tests on transformers 4.x.
"""

import json

import pytest
from tokenizers import Tokenizer

import eigenhooks as eh
from eigenhooks.zoo.train import PORTABLE_TOKENIZER_CLASS, portable_tokenizer_config

TEXTS = ["def f(x):\n    return x", "The [MASK] of a class is\tits namespace.", "  ünïcode ✓"]


@pytest.mark.parametrize("name", eh.zoo.TINY)
def test_tokenizer_config_names_a_class_both_majors_know(name):
    cfg = json.loads((eh.zoo.path(name) / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == PORTABLE_TOKENIZER_CLASS and "backend" not in cfg


@pytest.mark.parametrize("name", eh.zoo.TINY)
def test_loaded_tokenizer_encodes_as_tokenizer_json(name):
    """AutoTokenizer (whichever transformers) against the tokenizers library reading tokenizer.json."""
    _, tok = eh.zoo.load(name)
    raw = Tokenizer.from_file(str(eh.zoo.path(name) / "tokenizer.json"))
    for text in TEXTS:
        assert tok(text)["input_ids"] == raw.encode(text).ids
    assert tok.pad_token is not None and tok.pad_token_id == raw.token_to_id(tok.pad_token)


def test_portable_config_rewrites_what_transformers_5_writes(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"backend": "tokenizers", "tokenizer_class": "TokenizersBackend", "pad_token": "[PAD]"})
    )
    portable_tokenizer_config(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg == {
        "pad_token": "[PAD]",
        "tokenizer_class": PORTABLE_TOKENIZER_CLASS,
        "model_input_names": ["input_ids", "attention_mask"],
    }


@pytest.mark.parametrize("name", eh.zoo.TINY)
def test_what_the_tokenizer_returns_runs_the_computation_of_its_ids(name):
    """``model(**tok(texts))`` is the forward of the ids and the mask, on 4.x as on 5.x. transformers 4.x's
    tokenizer also returned token_type_ids, and its GPT-2 added token 0's embedding to every position:
    the notebook's table on transformers 4.56 was another computation's (layer 0: rho 0.52, not 0.67)."""
    import torch

    model, tok = eh.zoo.load(name)
    enc = tok(TEXTS, return_tensors="pt", padding=True)
    assert sorted(enc.keys()) == ["attention_mask", "input_ids"]
    with torch.no_grad():
        got = model(**enc).logits
        want = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
    assert torch.equal(got, want)
