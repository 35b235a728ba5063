"""A GGUF's tokenizer follows what the file records: its special tokens and whether a BOS is prepended.

transformers 4.x built it without them: SmolLM2's file says BOS 1, EOS 2, pad 2 and no BOS, and 4.56
gave EOS 1, no pad and a BOS before every text, so a user's `tok(text)` was other tokens than on 5.x
and `tok(texts, padding=True)` failed. CI's floors and lens-3 environments run these tests on 4.x.
"""

from __future__ import annotations

import pytest

pytest.importorskip("gguf", reason="GGUF files need the gguf package")

from eigenhooks.zoo.gguf import load_gguf  # noqa: E402
from eigenhooks.zoo.gguf_file import metadata_scalars  # noqa: E402

from .gguf_tiny import write_tiny_gguf  # noqa: E402

BOS = EOS = 258  # <|endoftext|>
PAD = 257  # ' t'


@pytest.mark.parametrize("add_bos", [False, True])
def test_the_tokenizer_is_the_one_the_file_records(tmp_path, monkeypatch, add_bos):
    # a private models folder: the session's holds converted copies from other runs (and transformers)
    monkeypatch.setenv("EIGENHOOKS_MODELS", str(tmp_path / "models"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, pad_token_id=PAD, add_bos=add_bos)
    for _ in range(2):  # converted, then read back from the model cache
        _, tok = load_gguf(path)
        assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS, EOS, PAD)
        ids = tok("the tea")["input_ids"]
        assert ids == [BOS] * add_bos + [256, 101, 257, 101, 97], ids


def test_metadata_scalars_read_as_the_gguf_package_reads_them(tmp_path):
    import gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, pad_token_id=PAD, add_bos=False)
    keys = ["tokenizer.ggml.bos_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token"]
    fields = gguf.GGUFReader(str(path)).fields
    want = {k: fields[k].parts[fields[k].data[0]].tolist()[0] for k in keys}
    got = metadata_scalars(path, [*keys, "llama.block_count", "no.such.key", "tokenizer.ggml.tokens"])
    assert {k: got[k] for k in keys} == want == {keys[0]: BOS, keys[1]: PAD, keys[2]: False}
    assert got["llama.block_count"] == 2 and "no.such.key" not in got and "tokenizer.ggml.tokens" not in got


@pytest.mark.real
def test_smollm2s_tokenizer_is_the_one_its_file_records(smollm2):
    """On transformers 4.56 this was EOS 1, no pad and a BOS before every text, against the file's 2, 2, none."""
    from eigenhooks.zoo import real

    _, tok = smollm2
    keys = dict(
        bos="tokenizer.ggml.bos_token_id", eos="tokenizer.ggml.eos_token_id", pad="tokenizer.ggml.padding_token_id"
    )
    meta = metadata_scalars(real.require("smollm2-135m"), [*keys.values(), "tokenizer.ggml.add_bos_token"])
    assert {a: getattr(tok, f"{a}_token_id") for a in keys} == {a: meta[k] for a, k in keys.items()}
    assert meta["tokenizer.ggml.add_bos_token"] is False and tok("def add(a, b):")["input_ids"][0] != meta[keys["bos"]]
