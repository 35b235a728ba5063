"""Calibration for signed steering: the heads' outputs z entering a layer's output projection on
typical inputs, from which the signed read-out b is chosen (``rank1.free_vector``).

Typical inputs are the user's (``calibration=`` token ids or a dict of forward kwargs) or, by
default, text the model samples itself: 16 sequences of 8 tokens at temperature 1, seeded. The
sampler decodes with the model's KV cache (one token per forward after the first) where the model
returns one, and shows progress (``eigenhooks.progress``); ``sample_tokens_plain`` is its plain twin,
a full forward over the whole prefix at every step, which the fast one is tested against.

The shape sets the cost: each decode step reads every weight once, whatever the batch, so 16 x 8
(7 steps) samples the same 128 tokens as the 4 x 32 (31 steps) used before, for much less. Its
calibrated strength is checked against the old sampler's by ``benchmarks/steer_calibration_check.py``
(the figures are in docs/steering.md).

A sample is kept on disk too, beside the spectra (``EIGENHOOKS_CACHE``, folder ``calibration``), keyed
by every byte of the weights, the model's class and config, the shape and the seed: a later process
steering the same model reads its 128 token ids instead of sampling again (benchmarks/bench_steer_entry.py).
Like the spectrum cache it is an optimisation, never a source of truth: an entry whose key or checksum
does not match is a miss, and a folder that cannot be written is skipped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import weakref

import torch
import xxhash

from ..linalg.cache import CALIBRATION_DIR, cache_dir, tensors_digest
from ..models import Adapter, UnsupportedModelError
from ..models.base import StopForward
from ..models.probe import input_embeddings
from ..progress import bar

log = logging.getLogger(__name__)
N_CALIBRATION = (16, 8)  # sequences x tokens the model samples for calibration when none are given
_SAMPLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
SAMPLER_VERSION = 1  # in every disk key: bump it when ``_sample`` draws other tokens, and old entries miss


def token_logits(output) -> torch.Tensor | None:
    """The (batch, seq, vocab) logits of a model's output, or None where it has no LM head
    (a vision tower, CLIP, a classifier's (batch, labels) logits)."""
    logits = getattr(output, "logits", None) if not isinstance(output, torch.Tensor) else output
    return logits if isinstance(logits, torch.Tensor) and logits.dim() == 3 else None


def _vocab_size(model) -> int:
    emb = input_embeddings(model)
    n = getattr(emb, "num_embeddings", None)
    if n is None:
        n = getattr(getattr(model, "cfg", None), "d_vocab", None)
    if n is None:
        raise UnsupportedModelError(
            f"{type(model).__name__}: cannot tell its vocabulary size for random calibration tokens (its input "
            f"embedding is {type(emb).__name__}); pass calibration=input_ids, or a dict of its forward kwargs "
            "(e.g. {'pixel_values': images} for a vision tower)"
        )
    return int(n)


def _fingerprint(model) -> object:
    """xxh3-128 of every byte of every parameter (``p.data`` writes keep the version and a sample misses most
    edits); off the CPU a fresh object, equal to no key: hashing there would cost more than sampling again."""
    params = list(model.parameters())
    return tensors_digest(params) if all(p.device.type == "cpu" for p in params) else object()


def sample_tokens(model, shape=N_CALIBRATION, seed: int = 0, progress: bool | None = None) -> torch.Tensor:
    """Token ids (batch, seq) sampled from the model itself, seeded: its own typical text.

    Each sequence starts from a seeded random token; the rest is sampled at temperature 1 from the
    model's next-token distribution, with its KV cache where it returns one (full forwards otherwise:
    TransformerLens, models without a cache). The sample is remembered per model while its weights
    are unchanged (steering restores them bit-exactly), so repeated steers of one model sample once.
    """
    key = (tuple(shape), seed, _fingerprint(model))
    memo = _SAMPLES.setdefault(model, {})
    if key not in memo:
        memo.clear()
        disk = _disk_key(model, shape, seed, key[2]) if isinstance(key[2], str) else None
        ids = _load(disk, shape) if disk else None
        if ids is None:
            ids = _sample(model, shape, seed, cached=True, progress=progress)
            if disk:
                _save(disk, ids)
        memo[key] = ids
    return memo[key].clone()


def _config_text(model) -> str:
    """The model's config as text for the disk key (HF ``config``, TransformerLens ``cfg``); '' if none."""
    cfg = getattr(model, "config", None) or getattr(model, "cfg", None)
    if cfg is None:
        return ""
    to_dict = getattr(cfg, "to_dict", None)
    return json.dumps(to_dict(), sort_keys=True, default=str) if callable(to_dict) else repr(cfg)


def _disk_key(model, shape, seed: int, weights: str) -> str:
    """xxh3-128 of what the sample depends on: the weights' digest, the class and config, shape, seed, sampler."""
    meta = {"sampler": SAMPLER_VERSION, "class": type(model).__name__, "config": _config_text(model),
            "shape": list(shape), "seed": seed, "weights": weights}  # fmt: skip
    return xxhash.xxh3_128(json.dumps(meta, sort_keys=True).encode()).hexdigest()


def _checksum(key: str, ids: torch.Tensor) -> str:
    """BLAKE2 of the key, the shape and the ids' bytes."""
    h = hashlib.blake2b(key.encode() + str(tuple(ids.shape)).encode(), digest_size=20)
    h.update(ids.contiguous().numpy().tobytes())
    return h.hexdigest()


def _load(key: str, shape) -> torch.Tensor | None:
    """The kept sample of ``key``, or None: missing, unreadable, or not what its key and checksum say."""
    from safetensors import safe_open

    path = cache_dir() / CALIBRATION_DIR / f"{key}.safetensors"
    try:
        if not path.is_file():
            return None
        with safe_open(str(path), framework="pt") as f:
            meta, ids = f.metadata() or {}, f.get_tensor("ids")
        if meta.get("key") != key or meta.get("checksum") != _checksum(key, ids) or tuple(ids.shape) != tuple(shape):
            raise ValueError("key, checksum or shape mismatch (a damaged or swapped entry)")
        return ids.to(torch.long)
    except Exception as e:  # a bad entry is sampled again, never trusted
        log.warning("ignoring calibration cache entry %s: %s", path, e)
        return None


def _save(key: str, ids: torch.Tensor) -> None:
    """Keep a sample, atomically; a folder that cannot be written is skipped (logged), as the spectra's."""
    from safetensors.torch import save_file

    folder = cache_dir() / CALIBRATION_DIR
    path = folder / f"{key}.safetensors"
    tmp = path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        save_file({"ids": ids.contiguous()}, str(tmp), metadata={"key": key, "checksum": _checksum(key, ids)})
        os.replace(tmp, path)  # a reader never sees half a file
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        log.warning("cannot keep the calibration sample at %s: %s", folder, e)


def sample_tokens_plain(model, shape=N_CALIBRATION, seed: int = 0) -> torch.Tensor:
    """The plain twin of ``sample_tokens``: a full forward over the whole prefix at every step, no memo."""
    return _sample(model, shape, seed, cached=False, progress=False)


def _next_logits(out, model) -> torch.Tensor:
    logits = token_logits(out)
    if logits is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no LM head (its output has no (batch, seq, vocab) logits), so it "
            "cannot sample its own calibration text; pass calibration=input_ids or a dict of forward kwargs"
        )
    return logits[:, -1].to("cpu", torch.float64)  # (batch, vocab)


@torch.no_grad()
def _sample(model, shape, seed: int, cached: bool, progress: bool | None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    dev = next(model.parameters()).device
    ids = torch.randint(0, _vocab_size(model), (shape[0], 1), generator=g)  # (batch, 1)
    config = getattr(model, "config", None)
    # an HF decoder returns its cache when asked; an encoder (BERT) or TransformerLens returns none
    cached = cached and getattr(config, "use_cache", None) is not None and not getattr(config, "is_encoder_decoder", 0)
    name = _cache_argument(model) if cached else None  # transformers 5 says `cache`, 4.x `past_key_values`
    cached, cache = name is not None, None
    with bar("steering: sampling calibration text", shape[1] - 1, progress) as b:
        for _ in range(shape[1] - 1):
            if cache is not None:
                out = model(ids[:, -1:].to(dev), use_cache=True, **{name: cache})  # (batch, 1): the new token
            elif cached:
                out = model(ids.to(dev), use_cache=True)
            else:
                out = model(ids.to(dev))  # (batch, t): the whole prefix
            cache = _returned_cache(out) if cached else None
            cached = cache is not None  # no cache came back: full forwards from here on
            nxt = torch.multinomial(torch.softmax(_next_logits(out, model), -1), 1, generator=g)  # (batch, 1)
            ids = torch.cat([ids, nxt], 1)
            b.advance()
    return ids


def _cache_argument(model) -> str | None:
    """The name under which ``model.forward`` takes a KV cache, or None if it takes none."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    return next((n for n in ("cache", "past_key_values") if n in params), None) if "use_cache" in params else None


def _returned_cache(out):
    fields = getattr(out, "keys", lambda: ())()  # a ModelOutput holds only the fields that were set
    return next((out[n] for n in ("cache", "past_key_values") if n in fields and out[n] is not None), None)


def calibration_inputs(model, calibration, progress: bool | None = None):
    """(args, kwargs, mask) for the calibration forward; the model's own samples when None."""
    if calibration is None:
        return (sample_tokens(model, progress=progress),), {}, None
    if isinstance(calibration, torch.Tensor):
        if calibration.dtype != torch.long or calibration.dim() != 2:
            raise ValueError(
                f"calibration must be token ids (batch, seq) of dtype long, got {calibration.dtype} "
                f"{tuple(calibration.shape)}; or a tokenizer batch (dict)"
            )
        return (calibration,), {}, None
    if hasattr(calibration, "keys"):
        return (), dict(calibration), calibration.get("attention_mask")
    raise ValueError(f"calibration must be token ids or a tokenizer batch (dict), got {type(calibration).__name__}")


@torch.no_grad()
def value_activations(adapter: Adapter, o_proj, calibration=None, progress: bool | None = None) -> torch.Tensor:
    """The heads' outputs z (tokens, H*d_head) entering ``o_proj`` on calibration inputs, float64.

    The forward stops at ``o_proj`` (later layers do not run). Padding is left out.
    """
    model = adapter.model
    args, kwargs, mask = calibration_inputs(model, calibration, progress)
    dev = next(model.parameters()).device
    args = tuple(a.to(dev) for a in args)
    kwargs = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    got = {}

    def grab(module, inputs):
        got["z"] = inputs[0].detach()
        raise StopForward

    h = o_proj.register_forward_pre_hook(grab)
    try:
        model(*args, **kwargs)
    except StopForward:
        pass
    finally:
        h.remove()
    if "z" not in got:
        raise UnsupportedModelError(f"{adapter.family}: the calibration forward never reached the output projection")
    z = got["z"].to("cpu", torch.float64)  # (batch, seq, H*d_head)
    ly = next((ly for ly in adapter.layers if ly.o_proj is o_proj), None)
    if ly is not None and not getattr(ly, "masked", True):
        mask = None  # the attention_mask is another tower's (CLIP's text mask, a vision layer steered)
    elif any(ly.o_proj is o_proj and ly.stack == "decoder" for ly in adapter.layers):
        mask = kwargs.get("decoder_attention_mask")  # an encoder-decoder's decoder layer: the decoder's own mask
    if mask is not None:
        return z[mask.to("cpu").bool()]
    return z.reshape(-1, z.shape[-1])
