"""GGUF checkpoints: dequantised by transformers, the tokenizer read from the same file."""

from __future__ import annotations

from pathlib import Path

from .errors import ModelLoadError


def load_gguf(path, dtype=None, device=None):
    """Load a GGUF checkpoint with transformers: weights dequantised, tokenizer from the same file.

    Args:
        path: the ``.gguf`` file.
        dtype: torch dtype to cast the dequantised weights to (default float32).
        device: device to move the model to.

    Returns:
        (model, tokenizer), the model in eval mode.

    Raises:
        ModelLoadError: no such file, the ``gguf`` package missing, or a file transformers
            cannot read or dequantise (its architecture or quantisation type is not supported).
    """
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"no GGUF file at {str(path)!r}")
    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError(f"reading {path.name} needs the 'gguf' package: pip install gguf")
    kwargs = {"gguf_file": path.name, "local_files_only": True}
    extra = {"dtype": dtype} if dtype is not None else {}
    try:  # newer transformers can keep GGUF blocks packed (no dense .weight to read F from): unpack them
        from transformers import GgufConfig

        extra["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older transformers always dequantise
        pass
    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, **kwargs, **extra)
        tok = AutoTokenizer.from_pretrained(path.parent, **kwargs)
    except (ValueError, KeyError, NotImplementedError, OSError, RuntimeError, TypeError) as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"transformers cannot load or dequantise {path.name}: {why}") from e
    if device is not None:
        model = model.to(device)
    return model.eval(), tok
