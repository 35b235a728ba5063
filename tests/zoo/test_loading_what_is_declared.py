"""Loading what the checkpoint declares, saying what was not in it, and unknown words.

Small local checkpoints are written in tmp_path with ``save_pretrained`` (no hub): a BERT
saved as its bare body, as a masked LM, and a body whose config claims a head it lacks.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import transformers as T
from typer.testing import CliRunner

import eigenhooks as eh
from eigenhooks.cli import app
from eigenhooks.run.texts import TokenBatches, UnknownTokenWarning
from eigenhooks.zoo.loading import UNTRAINED_HEAD, LoadWarning, load_model

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "and", "##s", ".", "is", "big", "small"]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _tokenizer(folder):
    folder.mkdir(parents=True, exist_ok=True)
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(SPECIAL + WORDS) + "\n")
    # WordPiece; transformers 5 takes vocab= (it ignores vocab_file=), 4.x takes vocab_file=
    key = "vocab" if int(T.__version__.split(".")[0]) >= 5 else "vocab_file"
    return T.BertTokenizer(**{key: str(vocab)})


def _config():
    return T.BertConfig(
        vocab_size=len(SPECIAL) + len(WORDS),
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
    )


def _save(tmp_path, name: str, cls, architectures=None):
    folder = tmp_path / name
    tok = _tokenizer(folder)
    torch.manual_seed(0)
    model = cls(_config())
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    if architectures is not None:  # what a hand-edited or mislabelled config.json declares
        cfg = json.loads((folder / "config.json").read_text())
        cfg["architectures"] = architectures
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder, model


def test_the_declared_architecture_is_loaded(tmp_path):
    for cls in (T.BertModel, T.BertForMaskedLM):
        folder, saved = _save(tmp_path, cls.__name__, cls)
        assert json.loads((folder / "config.json").read_text())["architectures"] == [cls.__name__]
        with warnings.catch_warnings():
            warnings.simplefilter("error", LoadWarning)  # every weight came from the checkpoint
            model, tok = load_model(str(folder))
        assert type(model) is cls, f"{cls.__name__} checkpoint loaded as {type(model).__name__}"
        assert not getattr(model, UNTRAINED_HEAD, False)
        assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), model.state_dict().values()))
        assert isinstance(tok, T.PreTrainedTokenizerBase)


def test_a_head_missing_from_the_checkpoint_is_flagged(tmp_path):
    folder, _ = _save(tmp_path, "body-claims-head", T.BertModel, architectures=["BertForMaskedLM"])
    with pytest.warns(LoadWarning, match=r"BertForMaskedLM head is untrained \(token probabilities are meaningless\)"):
        model, _ = load_model(str(folder))
    assert type(model) is T.BertForMaskedLM and getattr(model, UNTRAINED_HEAD) is True


def test_steer_report_refuses_token_probabilities_of_an_untrained_head(tmp_path):
    folder, _ = _save(tmp_path, "body-claims-head", T.BertModel, architectures=["BertForMaskedLM"])
    with pytest.warns(LoadWarning):
        model, tok = load_model(str(folder))
    ids = tok(["the cat sat on the mat ."], return_tensors="pt")
    u = torch.nn.functional.normalize(
        torch.randn(16, dtype=torch.float64, generator=torch.Generator().manual_seed(0)), dim=0
    )
    with eh.steer(model, u, calibration=ids["input_ids"]) as s, torch.no_grad():
        model(**ids)
        with pytest.raises(
            ValueError, match="no token probabilities: BertForMaskedLM's LM head is not in its checkpoint"
        ):
            s.summary(target_token=tok.convert_tokens_to_ids("cat"))
        rep = s.summary()  # the spectrum and the alignment still mean something
    assert rep.prob_before is None and rep.alignment_after is not None


def test_cli_steer_prints_no_token_table_for_an_untrained_head(tmp_path):
    folder, _ = _save(tmp_path, "body-claims-head", T.BertModel, architectures=["BertForMaskedLM"])
    r = CliRunner().invoke(app, ["steer", str(folder), "--toward", "cat", "--prompt", "the cat sat on the"])
    assert r.exit_code == 0, r.output
    notes = [line for line in r.output.splitlines() if line.startswith("no token table")]
    assert len(notes) == 1 and "not in the checkpoint and was initialised randomly" in notes[0], r.output
    assert "before" not in r.output and "p('cat')" not in r.output and "Traceback" not in r.output


def test_cli_steer_on_a_bare_body_says_it_has_no_head(tmp_path):
    folder, _ = _save(tmp_path, "body", T.BertModel)
    r = CliRunner().invoke(app, ["steer", str(folder), "--toward", "cat"])
    assert r.exit_code == 1 and "loaded as BertModel, which has no LM head" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output


def test_words_missing_from_a_wordpiece_vocabulary_warn_with_the_count(tmp_path):
    tok = _tokenizer(tmp_path / "tok")
    text = "the cat sat on the zebra . the dog ran and the giraffe is big"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    n_unk = ids.count(tok.unk_token_id)
    assert n_unk == 2  # zebra, giraffe
    batches = TokenBatches(tok, [text], max_tokens=100, seq_len=4, batch_size=2)
    got = torch.cat([b.reshape(-1) for b in batches])
    assert batches.n_unknown == int((got == tok.unk_token_id).sum()) == n_unk
    with pytest.warns(UnknownTokenWarning, match=rf"^{n_unk} of {len(ids)} tokens of the text became \[UNK\]"):
        batches.warn_unknown()
    clean = TokenBatches(tok, ["the cat sat on the mat"], max_tokens=100, seq_len=4, batch_size=2)
    list(clean)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownTokenWarning)
        clean.warn_unknown()


def test_cli_run_warns_about_unknown_words(tmp_path):
    folder, _ = _save(tmp_path, "mlm", T.BertForMaskedLM)
    text = "the cat sat on the zebra . the dog ran and the giraffe is big"
    args = ["run", str(folder), "--text", text, "--out", str(tmp_path / "out")]
    r = CliRunner().invoke(app, args)
    lines = [x for x in r.output.splitlines() if "became [UNK]" in x]
    assert r.exit_code == 0, r.output
    assert len(lines) == 1 and lines[0].startswith("eigenhooks: warning: 2 of "), r.output
