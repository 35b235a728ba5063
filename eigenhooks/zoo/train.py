"""Rebuild the zoo: two tiny models trained on Python's bundled documentation.

The corpus is ``pydoc_data.topics``, which ships with every CPython, so the models can be
rebuilt offline anywhere. Everything is seeded; on 2 CPU cores each model trains in a
few minutes.

Usage::

    python -m eigenhooks.zoo.train            # both models, into eigenhooks/zoo/
    python -m eigenhooks.zoo.train gpt2-tiny --steps 100 --out /tmp/zoo
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

ZOO_DIR = Path(__file__).resolve().parent
VOCAB_SIZE = 1024
SPECIALS = ["<|endoftext|>", "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
SEED = 0


def corpus() -> tuple[str, str]:
    """Return (train, held_out) text: topics sorted by name, every 10th held out."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    train = [topics[n] for i, n in enumerate(names) if i % 10 != 3]
    held = [topics[n] for i, n in enumerate(names) if i % 10 == 3]
    return "\n\n".join(train), "\n\n".join(held)


def build_tokenizer(text: str):
    """A byte-level BPE with VOCAB_SIZE entries, trained on the corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.split("\n\n"), trainer)
    return tok


PORTABLE_TOKENIZER_CLASS = "PreTrainedTokenizerFast"  # a name transformers 4.x and 5.x both resolve


MODEL_INPUT_NAMES = ("input_ids", "attention_mask")


def portable_tokenizer_config(folder: Path) -> None:
    """Make ``tokenizer_config.json`` readable by transformers 4.x as well as 5.x.

    transformers 5 saves ``"tokenizer_class": "TokenizersBackend"`` and ``"backend": "tokenizers"``;
    4.x knows neither and fails with "Tokenizer class TokenizersBackend does not exist". Both
    majors read the same ``tokenizer.json`` through ``PreTrainedTokenizerFast`` (5.x keeps the name
    as an alias of its backend), so the class is named that way and the 5.x-only key dropped.

    The inputs are named as 5.x gives them, ``input_ids`` and ``attention_mask``: 4.x's
    ``PreTrainedTokenizerFast`` also returns ``token_type_ids`` by default, and 4.x's GPT-2 adds
    ``wte(token_type_ids)`` (token 0's embedding) to every position, so ``model(**tok(text))`` ran
    another computation there than ``model(input_ids)`` or than on 5.x.
    """
    path = Path(folder) / "tokenizer_config.json"
    cfg = json.loads(path.read_text(encoding="utf-8"))
    cfg.pop("backend", None)
    cfg["tokenizer_class"] = PORTABLE_TOKENIZER_CLASS
    cfg["model_input_names"] = list(MODEL_INPUT_NAMES)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def wrap_tokenizer(tok, kind: str):
    """Wrap the raw tokenizer for a causal LM (BOS prepended) or a masked LM ([CLS] ... [SEP])."""
    import copy

    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = copy.deepcopy(tok)
    if kind == "causal":
        bos = SPECIALS[0]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
        return PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token=bos,
            eos_token=bos,
            pad_token=bos,
            unk_token=bos,
            add_bos_token=True,
            model_max_length=256,
        )
    cls, sep = "[CLS]", "[SEP]"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B {sep}",
        special_tokens=[(cls, tok.token_to_id(cls)), (sep, tok.token_to_id(sep))],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        cls_token=cls,
        sep_token=sep,
        pad_token="[PAD]",
        unk_token="[UNK]",
        mask_token="[MASK]",
        model_max_length=256,
    )


def make_model(name: str):
    from transformers import AlbertConfig, AlbertForMaskedLM, GPT2Config, GPT2LMHeadModel

    if name == "gpt2-tiny":
        cfg = GPT2Config(
            vocab_size=VOCAB_SIZE,
            n_positions=256,
            n_embd=128,
            n_layer=4,
            n_head=4,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
        return GPT2LMHeadModel(cfg)
    if name == "albert-tiny":
        cfg = AlbertConfig(
            vocab_size=VOCAB_SIZE,
            embedding_size=128,
            hidden_size=128,
            num_hidden_layers=4,
            num_hidden_groups=1,
            num_attention_heads=4,
            intermediate_size=512,
            max_position_embeddings=256,
            hidden_act="gelu_new",
            pad_token_id=1,
            bos_token_id=3,
            eos_token_id=4,
        )
        return AlbertForMaskedLM(cfg)
    raise ValueError(f"unknown zoo model {name!r}; expected 'gpt2-tiny' or 'albert-tiny'")


def batches(ids: torch.Tensor, block: int, batch: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, len(ids) - block, (batch,), generator=gen)
        yield torch.stack([ids[s : s + block] for s in starts.tolist()])


def mask_tokens(x: torch.Tensor, mask_id: int, gen: torch.Generator):
    """BERT-style masking: 15% of positions are predicted; of those 80% [MASK], 10% random."""
    labels = x.clone()
    chosen = torch.rand(x.shape, generator=gen) < 0.15
    labels[~chosen] = -100
    r = torch.rand(x.shape, generator=gen)
    x = x.clone()
    x[chosen & (r < 0.8)] = mask_id
    rand = chosen & (r >= 0.8) & (r < 0.9)
    x[rand] = torch.randint(len(SPECIALS), VOCAB_SIZE, (int(rand.sum()),), generator=gen)
    return x, labels


def loss_of(model, x, kind, mask_id, gen):
    if kind == "causal":
        return model(input_ids=x, labels=x).loss
    xm, labels = mask_tokens(x, mask_id, gen)
    return model(input_ids=xm, labels=labels).loss


@torch.no_grad()
def held_out_loss(model, ids, kind, mask_id, block=128, n=32):
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    losses = []
    for i in range(n):
        s = (i * (len(ids) - block)) // n
        x = ids[s : s + block][None]
        losses.append(float(loss_of(model, x, kind, mask_id, gen)))
    return sum(losses) / len(losses)


def train(
    name: str, steps: int, out: Path, batch: int = 16, block: int = 128, lr: float = 3e-3, eval_blocks: int = 32
) -> dict:
    """Train one zoo model, seeded, and save it with its card under ``out / name``; ``eval_blocks`` blocks of
    128 held-out tokens give the card's held-out losses (before and after). Returns the card."""
    torch.manual_seed(SEED)
    torch.set_num_threads(2)
    train_text, held_text = corpus()
    raw = build_tokenizer(train_text)
    kind = "causal" if name.startswith("gpt2") else "masked"
    tokenizer = wrap_tokenizer(raw, kind)
    enc = lambda t: torch.tensor(raw.encode(t).ids, dtype=torch.long)  # noqa: E731 - no specials
    train_ids, held_ids = enc(train_text), enc(held_text)
    mask_id = raw.token_to_id("[MASK]")

    model = make_model(name)
    untrained = held_out_loss(model, held_ids, kind, mask_id, n=eval_blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    gen = torch.Generator().manual_seed(SEED)
    data = batches(train_ids, block, batch, gen)
    t0, running = time.time(), None
    model.train()
    for step in range(steps):
        loss = loss_of(model, next(data), kind, mask_id, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        lv = float(loss.detach())
        running = lv if running is None else 0.98 * running + 0.02 * lv
        if step % 100 == 0 or step == steps - 1:
            print(f"{name} step {step:5d} loss {running:.3f} ({time.time() - t0:.0f}s)", flush=True)
    model.eval()
    final_train = running
    trained = held_out_loss(model, held_ids, kind, mask_id, n=eval_blocks)

    target = out / name
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    portable_tokenizer_config(target)
    card = {
        "name": name,
        "architecture": type(model).__name__,
        "objective": "next-token prediction" if kind == "causal" else "masked-token prediction (15%)",
        "data": "pydoc_data.topics (Python's bundled documentation); topics sorted by name, every 10th held out",
        "train_tokens": len(train_ids),
        "held_out_tokens": len(held_ids),
        "tokenizer": f"byte-level BPE, {VOCAB_SIZE} entries, trained on the training split",
        "steps": steps,
        "batch": batch,
        "block": block,
        "lr": lr,
        "seed": SEED,
        "final_train_loss_ema": round(final_train, 4),
        "held_out_loss_untrained": round(untrained, 4),
        "held_out_loss_trained": round(trained, 4),
        "train_seconds": round(time.time() - t0, 1),
        "torch": torch.__version__,
    }
    (target / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    (target / "README.md").write_text(model_card_md(card))
    return card


def model_card_md(card: dict) -> str:
    rows = "\n".join(f"| {k} | {v} |" for k, v in card.items())
    return (
        f"# {card['name']}\n\nA tiny {card['architecture']} trained by eigenhooks for its examples and tests.\n"
        "It is a toy: it knows the shape of Python documentation, nothing more.\n"
        "Rebuild it with `python -m eigenhooks.zoo.train " + card["name"] + "`.\n\n"
        f"| field | value |\n|---|---|\n{rows}\n"
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", default=["gpt2-tiny", "albert-tiny"])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--out", type=Path, default=ZOO_DIR)
    a = p.parse_args(argv)
    for n in a.names:
        print(json.dumps(train(n, a.steps, a.out), indent=2))


if __name__ == "__main__":
    main()
