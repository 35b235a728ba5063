"""One check list for every architecture, and the table it fills (docs/coverage.md).

A ``Case`` is a seeded tiny model of one architecture plus what a test needs to know
that the adapter must not tell it: an independent reference for the ``mid`` state,
built from the test's own hooks on the model's own modules. ``tests/models/test_every_family.py``
runs every check on every case; the cases live in ``tests/cases/``, one file per kind.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import transformers as T
from torch import nn

from eigenhooks.models.base import as_tokens

# The tiny Llama-style config of the decoder cases, here (not in cases/decoders.py) so that conftest
# does not import the cases, whose families a transformers 4.x lacks (tests/cases/ runs on 5.x).
DECODER_BASE = dict(
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    hidden_size=16,
    intermediate_size=32,
    vocab_size=64,
    max_position_embeddings=32,
)

# One size guard for every test model (the registry's, the cases', the zoo's ~1M-parameter tiny ones, the
# GGUF writer's): a misspelt config key must not silently build a full-size model (GPT-2 small: 124M).
MAX_PARAMS = 2_000_000


def assert_tiny(model) -> None:
    n = sum(p.numel() for p in model.parameters())
    assert n < MAX_PARAMS, f"{type(model).__name__} has {n} parameters: not a tiny test model"


# The one registry of tiny models: family -> (model class with a head, bare class, config). The cases
# (tests/cases/) build their models of these families from it; harness.build redraws its weights.

FAMILY_CONFIGS = {
    "gpt2": (
        T.GPT2LMHeadModel,
        T.GPT2Model,
        lambda: T.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=64, n_positions=32),
    ),
    "distilgpt2": (
        T.GPT2LMHeadModel,
        T.GPT2Model,
        lambda: T.GPT2Config(n_layer=3, n_head=4, n_embd=16, vocab_size=64, n_positions=32),
    ),
    "gpt_neo": (
        T.GPTNeoForCausalLM,
        T.GPTNeoModel,
        lambda: T.GPTNeoConfig(
            num_layers=2,
            num_heads=2,
            hidden_size=16,
            vocab_size=64,
            max_position_embeddings=32,
            attention_types=[[["global", "local"], 1]],
            window_size=4,
        ),
    ),
    "gpt_neox": (
        T.GPTNeoXForCausalLM,
        T.GPTNeoXModel,
        lambda: T.GPTNeoXConfig(
            num_hidden_layers=2,
            num_attention_heads=2,
            hidden_size=16,
            intermediate_size=32,
            vocab_size=64,
            max_position_embeddings=32,
        ),
    ),
    "gptj": (
        T.GPTJForCausalLM,
        T.GPTJModel,
        lambda: T.GPTJConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=64, rotary_dim=4, n_positions=32),
    ),
    "bert": (
        T.BertForMaskedLM,
        T.BertModel,
        lambda: T.BertConfig(
            num_hidden_layers=2,
            num_attention_heads=2,
            hidden_size=16,
            intermediate_size=32,
            vocab_size=64,
            max_position_embeddings=32,
        ),
    ),
    "roberta": (
        T.RobertaForMaskedLM,
        T.RobertaModel,
        lambda: T.RobertaConfig(
            num_hidden_layers=2,
            num_attention_heads=2,
            hidden_size=16,
            intermediate_size=32,
            vocab_size=64,
            max_position_embeddings=40,
        ),
    ),
    "distilbert": (
        T.DistilBertForMaskedLM,
        T.DistilBertModel,
        lambda: T.DistilBertConfig(
            n_layers=2, n_heads=2, dim=16, hidden_dim=32, vocab_size=64, max_position_embeddings=32
        ),
    ),
    "albert": (
        T.AlbertForMaskedLM,
        T.AlbertModel,
        lambda: T.AlbertConfig(
            num_hidden_layers=4,
            num_hidden_groups=2,
            num_attention_heads=2,
            hidden_size=16,
            embedding_size=8,
            intermediate_size=32,
            vocab_size=64,
            max_position_embeddings=32,
        ),
    ),
    "albert_inner2": (
        T.AlbertForMaskedLM,
        T.AlbertModel,
        lambda: T.AlbertConfig(
            num_hidden_layers=2,
            num_hidden_groups=1,
            inner_group_num=2,
            num_attention_heads=2,
            hidden_size=16,
            embedding_size=16,
            intermediate_size=32,
            vocab_size=64,
            max_position_embeddings=32,
        ),
    ),
    "llama": (
        T.LlamaForCausalLM,
        T.LlamaModel,
        lambda: T.LlamaConfig(**DECODER_BASE),
    ),
    "mistral": (
        T.MistralForCausalLM,
        T.MistralModel,
        lambda: T.MistralConfig(**{**DECODER_BASE, "num_key_value_heads": 1, "head_dim": 4}),
    ),
    "qwen2": (
        T.Qwen2ForCausalLM,
        T.Qwen2Model,
        lambda: T.Qwen2Config(**DECODER_BASE),
    ),
    "opt": (
        T.OPTForCausalLM,
        T.OPTModel,
        lambda: T.OPTConfig(
            num_hidden_layers=2,
            num_attention_heads=2,
            hidden_size=16,
            ffn_dim=32,
            vocab_size=64,
            word_embed_proj_dim=16,
            max_position_embeddings=32,
        ),
    ),
    "opt_postnorm": (
        T.OPTForCausalLM,
        T.OPTModel,
        lambda: T.OPTConfig(
            num_hidden_layers=2,
            num_attention_heads=2,
            hidden_size=16,
            ffn_dim=32,
            vocab_size=64,
            word_embed_proj_dim=16,
            max_position_embeddings=32,
            do_layer_norm_before=False,
        ),
    ),
}


# Results by (case, column), filled by the tests and written to docs/coverage.md at the end.
RESULTS: dict[tuple[str, str], str] = {}
COLUMNS = ("F from weights", "verify", "mid", "padded", "generate", "steer")


@dataclass
class Case:
    """One architecture's seeded tiny model and its independent references.

    Attributes:
        build: () -> the model (with a head where the family has one), eval mode.
        family: the ``adapter.family`` expected.
        mid: (model, inputs) -> {layer: (b, n, d) mid state}, computed from the test's own
            hooks on the model's modules, never from the adapter's taps. None where the
            adapter documents that no mid state exists (parallel blocks).
        inputs: (model, padded) -> forward kwargs; ``padded`` adds left padding to row 0 and
            must carry an ``attention_mask`` (or, for inputs without one, return None).
        generate: the model generates with a KV cache (a decoder LM head).
        steer: a weight rule exists, so ``steer`` must work and restore the weights.
        probe_only: layers with no weight rule (verify checks the probe's linearity).
        nonlinear: layers whose value path is nonlinear (F from weights is a linearisation).
        atol: F(weights) vs F(probe), relative to max |F|.
        name: the label in the table (the architecture's model_type and variant).
    """

    build: Callable[[], nn.Module]
    family: str
    mid: Callable | None
    inputs: Callable | None = None
    generate: bool = False
    steer: bool = True
    probe_only: bool = False
    nonlinear: bool = False
    atol: float = 1e-5
    stacks: tuple[str, ...] = ("",)
    notes: str = ""
    extra: dict = field(default_factory=dict)


def build(family: str, bare: bool = False, dtype=torch.float64, seed: int = 0, std: float = 0.3):
    """A seeded tiny model of `family` (``harness.FAMILY_CONFIGS``), its weights redrawn at `std` so F is O(1)."""
    head_cls, bare_cls, cfg = FAMILY_CONFIGS[family]
    torch.manual_seed(seed)
    model = (bare_cls if bare else head_cls)(cfg())
    assert_tiny(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model.to(dtype).eval()


def family_model(family: str, **overrides) -> nn.Module:
    """A model of the registry's ``family`` (its head class), its config changed by ``overrides``."""
    head, _, cfg = FAMILY_CONFIGS[family]
    c = cfg()
    for k, v in overrides.items():
        setattr(c, k, v)
    return head(c)


def seeded(fn: Callable[[], nn.Module], seed: int = 0) -> Callable[[], nn.Module]:
    """Build under a fixed seed, in eval mode, with a size guard; scale weights up so F is not tiny."""

    def build():
        torch.manual_seed(seed)
        m = fn().eval()
        assert_tiny(m)
        return m

    return build


def token_inputs(vocab: int = 64, n: int = 7, b: int = 2, seed: int = 1) -> Callable:
    """(model, padded) -> input_ids and attention_mask; row 0 left-padded by 3 when padded."""

    def make(model, padded: bool):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, vocab, (b, n), generator=g)
        mask = torch.ones_like(ids)
        if padded:
            mask[0, :3] = 0
        return {"input_ids": ids, "attention_mask": mask}

    return make


@contextlib.contextmanager
def record(modules: list[nn.Module]):
    """Capture every call of each module: its first input and its output (first of a tuple).

    Yields {id(module): [(input, output), ...]} in call order.
    """
    got: dict[int, list] = {id(m): [] for m in modules}
    hs = []
    for m in {id(m): m for m in modules}.values():

        def pre(mod, args, kwargs):
            x = args[0] if args else kwargs.get("hidden_states")
            got[id(mod)].append([x.detach().clone() if isinstance(x, torch.Tensor) else x, None])

        def post(mod, args, out):
            o = out[0] if isinstance(out, tuple) else out
            got[id(mod)][-1][1] = o.detach().clone() if isinstance(o, torch.Tensor) else o

        hs.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        hs.append(m.register_forward_hook(post))
    try:
        yield got
    finally:
        for h in hs:
            h.remove()


def nth_calls(got: dict, modules: list[nn.Module]) -> list:
    """(input, output) of the j-th use of each module, for an unrolled list that may repeat modules."""
    seen: dict[int, int] = {}
    out = []
    for m in modules:
        j = seen.get(id(m), 0)
        seen[id(m)] = j + 1
        out.append(got[id(m)][j])
    return out


def sum_mid(blocks: Callable, attn: Callable, then: Callable | None = None, scale: Callable | None = None) -> Callable:
    """An independent mid: the block's input plus its attention output, as the block adds them.

    Args:
        blocks: model -> the unrolled block list (one entry per attention application).
        attn: block -> the module whose output is added to the residual.
        then: (block, x) -> x, applied after the add (post-norm: the block's norm).
        scale: block -> the factor the attention output is multiplied by (granite's multiplier).
    """

    def mid(model, inputs):
        bl = list(blocks(model))
        at = [attn(b) for b in bl]
        with record(bl + at) as got:
            model(**inputs)
        res = {}
        for i, ((x, _), (_, a)) in enumerate(zip(nth_calls(got, bl), nth_calls(got, at))):
            y = x + (a if scale is None else scale(bl[i]) * a)
            res[i] = y if then is None else then(bl[i], y)
        return res

    return mid


def tap_values(adapter, inputs: dict, point: str) -> dict[int, torch.Tensor]:
    """The tensor at each layer's ``point`` tap ('pre', 'mid', 'post'), read from one forward."""
    rps = {i: adapter.reading_points(i) for i in range(adapter.n_layers)}
    got: dict[int, torch.Tensor] = {}
    calls: dict[int, int] = {}
    hs = []
    for i, rp in rps.items():
        tap = getattr(rp, point)
        if tap is None:
            continue
        uses = [j for j, r in rps.items() if getattr(r, point) == tap]  # a shared module is called once per use

        if tap.where == "input":

            def hook(mod, args, kwargs, i=i, uses=uses):
                x = args[0] if args else kwargs.get("hidden_states")
                calls[i] = calls.get(i, 0) + 1
                if uses[(calls[i] - 1) % len(uses)] == i:
                    got[i] = x.detach().clone()

            hs.append(tap.module.register_forward_pre_hook(hook, with_kwargs=True))
        else:

            def hook(mod, args, out, i=i, uses=uses):
                o = out[0] if isinstance(out, tuple) else out
                calls[i] = calls.get(i, 0) + 1
                if uses[(calls[i] - 1) % len(uses)] == i:
                    got[i] = o.detach().clone()

            hs.append(tap.module.register_forward_hook(hook))
    pre: dict[int, torch.Tensor] = {}  # only its shape is used
    for i in range(adapter.n_layers):
        tap = rps[i].pre

        def keep(i, t):
            pre.setdefault(i, t[0] if isinstance(t, tuple) else t)

        if tap.where == "input":
            hs.append(
                tap.module.register_forward_pre_hook(
                    lambda m, a, k, i=i: keep(i, a[0] if a else k["hidden_states"]), with_kwargs=True
                )
            )
        else:
            hs.append(tap.module.register_forward_hook(lambda m, a, o, i=i: keep(i, o)))
    try:
        with torch.no_grad():
            adapter.model(**inputs)
    finally:
        for h in hs:
            h.remove()
    return {i: as_tokens(t, pre[i]) if i in pre else t for i, t in got.items()}


def write_table(path, names: list[str], versions: str) -> None:
    """docs/coverage.md from RESULTS."""
    lines = [
        "# Coverage",
        "",
        "Generated by `pytest tests/models/test_every_family.py` (each cell is a check that ran and passed, or says why",
        f"it does not apply), on {versions}. Every row is a seeded tiny model of that architecture.",
        "",
        "- **F from weights**: `weights` = F read from the weights equals the identical-token probe",
        "  (worst relative difference shown); `linearised` = a nonlinear value path, F is the linear map of the",
        "  weights and the probe only a local linearisation; `probe` = no weight rule.",
        "- **verify**: what `eh.verify` checked on every layer (`weights`, or the probe's `linearity`); never NaN.",
        "- **mid**: the adapter's `mid` equals the state the model forms, captured by the test's own hooks",
        "  (`pre+attn` = parallel block, mid is defined as pre + attention output).",
        "- **padded**: a left-padded batch counts exactly the real tokens.",
        "- **generate**: `generate` with a KV cache counts every fed token once, in one cluster per row.",
        "- **steer**: `steer` runs and restores the weights bit-exactly.",
        "",
        "| architecture | " + " | ".join(COLUMNS) + " |",
        "|---|" + "---|" * len(COLUMNS),
    ]
    for n in names:
        lines.append(f"| {n} | " + " | ".join(RESULTS.get((n, c), "—") for c in COLUMNS) + " |")
    open(path, "w").write("\n".join(lines) + "\n")
