"""Load a model by zoo name, GGUF file, local folder or hub id, for the CLI and for users."""

from __future__ import annotations

from pathlib import Path

from . import registry
from .errors import ModelLoadError
from .gguf import load_gguf
from .real import REAL, FetchError, pinned_name, require


def load_model(spec: str, dtype=None, device=None, backend: str = "hf"):
    """Return (model, tokenizer) for a zoo name, a GGUF file, a local folder or a hub id.

    Args:
        spec: a zoo name ('gpt2-tiny', 'albert-tiny', or a fetched real model such as
            'smollm2-135m'), a ``.gguf`` file (dequantised by transformers, tokenizer read from
            the same file, once: later loads read the converted copy in the model cache, see
            ``gguf``), a folder saved with ``save_pretrained``, or a hub id.
        dtype: torch dtype to load in (default: as saved).
        device: device to move the model to.
        backend: 'hf', or 'lens' to wrap the model in a TransformerLens TransformerBridge.

    Raises:
        ModelLoadError: unknown name, missing folder or file, a real model not fetched yet,
            a GGUF file that is not whole (truncated, empty, not GGUF) or that transformers cannot
            read, a fetched file that no longer matches its pin, or the hub unreachable.
    """
    if backend not in ("hf", "lens"):
        raise ModelLoadError(f"backend must be 'hf' or 'lens', got {backend!r}")
    if spec in registry.NAMES:
        try:
            model, tok = registry.load(spec, dtype=dtype, device=device)
        except FetchError as e:
            raise ModelLoadError(str(e)) from e
    elif spec.lower().endswith(".gguf"):
        model, tok = load_gguf(spec, dtype=dtype, device=device, sha256=_pin_checked(spec))
    else:
        model, tok = _load_hf(spec, dtype, device)
    if backend == "lens":
        model = to_bridge(model, tok, spec, dtype)
    return model, tok


def _pin_checked(path: str) -> str | None:
    """A fetched real model's file given by its path gets the pin check its name gets: its SHA-256, or None
    for any other file."""
    name = pinned_name(Path(path).expanduser())
    if name is None:
        return None
    try:
        require(name)
    except FetchError as e:
        raise ModelLoadError(str(e)) from e
    return REAL[name].sha256


class LoadWarning(UserWarning):
    """A model loaded, but not all of it came from the checkpoint (e.g. a randomly initialised head)."""


UNTRAINED_HEAD = "eigenhooks_untrained_head"  # set True on a model whose head was initialised randomly


def _load_hf(spec: str, dtype, device):
    from transformers import AutoTokenizer

    local = Path(spec).expanduser()
    if not local.exists() and (spec.startswith((".", "/", "~")) or spec.count("/") > 1):
        raise ModelLoadError(f"no model folder at {spec!r}")
    src = str(local) if local.exists() else spec
    config = _config(spec, local, src)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    last = None
    for cls in _classes(config):
        try:
            model, info = cls.from_pretrained(src, output_loading_info=True, **kwargs)
            break
        except (ValueError, OSError, KeyError) as e:
            last = e
    else:
        raise ModelLoadError(f"could not load {spec!r} with transformers: {last}") from last
    _check_loaded(spec, model, info)
    try:
        tok = AutoTokenizer.from_pretrained(src)
    except (OSError, ValueError):
        tok = None
    if device is not None:
        model = model.to(device)
    return model.eval(), tok


def _config(spec: str, local: Path, src: str):
    """The checkpoint's config; a damaged local config.json is reported as such, not as a hub failure."""
    import json

    from transformers import AutoConfig

    if local.is_dir():
        cfg = local / "config.json"
        if not cfg.is_file():
            raise ModelLoadError(f"{local} has no config.json: not a model folder (save one with save_pretrained)")
        try:
            json.loads(cfg.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{cfg} is not valid JSON ({e}): the checkpoint is damaged; re-save it") from e
    try:
        return AutoConfig.from_pretrained(src)
    except ValueError as e:  # e.g. no model_type: transformers' own message says which key
        raise ModelLoadError(f"could not read the config of {spec!r}: {str(e).splitlines()[0]}") from e
    except OSError as e:
        if local.is_dir():
            raise ModelLoadError(f"could not read the config of {spec!r}: {str(e).splitlines()[0]}") from e
        raise ModelLoadError(
            f"could not load {spec!r}: not a zoo name ({', '.join(registry.NAMES)}), not a local folder, "
            f"and the hub did not answer ({type(e).__name__}). Offline? Save the model with "
            "save_pretrained and pass its folder."
        ) from e


def _classes(config) -> list:
    """The model classes to try: the architecture the checkpoint declares, else Auto classes by head."""
    import transformers
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM

    declared = [getattr(transformers, a, None) for a in (config.architectures or [])]
    declared = [c for c in declared if c is not None and hasattr(c, "from_pretrained")]
    if declared:
        return declared[:1]
    return [AutoModelForCausalLM, AutoModelForMaskedLM, AutoModel]


def _check_loaded(spec: str, model, info: dict) -> None:
    """Warn about weights transformers initialised randomly; mark a model whose head is untrained."""
    import warnings

    missing = sorted(info.get("missing_keys") or [])
    if not missing:
        return
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    head = [k for k in missing if prefix == "." or not k.startswith(prefix)]
    body = [k for k in missing if k not in head]
    shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
    what = []
    if head:
        setattr(model, UNTRAINED_HEAD, True)
        what.append(f"its {type(model).__name__} head is untrained (token probabilities are meaningless)")
    if body:
        what.append(f"{len(body)} body weights are random (spectra of those layers are of random weights)")
    warnings.warn(
        f"{spec}: {len(missing)} weights are not in the checkpoint and were initialised randomly ({shown}); "
        + "; ".join(what),
        LoadWarning,
        stacklevel=3,
    )


def to_bridge(model, tokenizer, name: str, dtype=None):
    """Wrap an HF model in a TransformerLens TransformerBridge (raw mode), offline."""
    try:
        from transformer_lens import TransformerBridge
    except ImportError as e:
        raise ModelLoadError(
            "the lens backend wraps the model in a TransformerBridge, which needs TransformerLens 4: "
            "pip install 'transformer-lens>=4' (TransformerLens 3's HookedTransformer works with eh.monitor "
            "and eh.spectra directly)"
        ) from e
    import torch

    dtype = dtype or next(model.parameters()).dtype or torch.float32
    arch_name = getattr(model.config, "model_type", name)
    return TransformerBridge.boot_transformers(arch_name, hf_model=model, tokenizer=tokenizer, dtype=dtype)
