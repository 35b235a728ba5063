"""GGUF checkpoints: dequantised by transformers once, then loaded from the converted copy.

The first load of a file checks its header (``gguf_file``), lets transformers dequantise the
weights and build the tokenizer from the file, and saves both as safetensors and tokenizer files
in the model cache (``store``), keyed by the file's SHA-256 and the transformers version. Every
load, the first included, reads the model from that verified copy, so the first and the later
loads give the same model.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

from ..progress import track
from . import digest, store
from .errors import ModelLoadError
from .gguf_file import check_gguf, check_magic, metadata_scalars

log = logging.getLogger(__name__)
_unwritable_warned: set[str] = set()


def load_gguf(path, dtype=None, device=None, sha256: str | None = None):
    """Load a GGUF checkpoint: weights dequantised, tokenizer from the same file, cached once converted.

    Args:
        path: the ``.gguf`` file.
        dtype: torch dtype to load the weights in (default float32, as transformers dequantises).
        device: device to move the model to.
        sha256: the file's SHA-256 if the caller has just verified it (a fetched, pinned file).

    Returns:
        (model, tokenizer), the model in eval mode.

    Raises:
        ModelLoadError: no such file, the ``gguf`` package missing, a file that is not a whole
            GGUF file (the message says what is wrong with it), or one transformers cannot read
            or dequantise (its architecture or quantisation type is not supported).

    Example:
        >>> model, tok = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")  # doctest: +SKIP
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelLoadError(
            f"{path} is a folder, not a GGUF file" if path.is_dir() else f"no GGUF file at {str(path)!r}"
        )
    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError(f"reading {path.name} needs the 'gguf' package: pip install gguf")
    check_magic(path)
    try:
        sha = sha256 or digest.sha256_file(path)
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror or e}") from e
    try:
        folder = store.get(path, sha, lambda into: _convert_into(path, into))
    except store.Unwritable as e:
        _warn_unwritable(e)
        model, tok = _convert(path)
        model = model.to(dtype) if dtype is not None else model
    else:
        model, tok = _load_entry(path, folder, dtype)
    if device is not None:
        model = model.to(device)
    return model.eval(), tok


def convert(path, sha256: str | None = None) -> Path:
    """Convert a GGUF file into the model cache (if it is not there yet) and return the entry's folder.

    Raises:
        ModelLoadError: as ``load_gguf``; also when the model cache cannot be written.
    """
    path = Path(path).expanduser()
    check_magic(path)
    sha = sha256 or digest.sha256_file(path)
    try:
        return store.get(path, sha, lambda into: _convert_into(path, into))
    except store.Unwritable as e:
        raise ModelLoadError(f"{e}: set EIGENHOOKS_CACHE to a writable folder") from e


def _convert(path: Path):
    """(model, tokenizer) dequantised by transformers from the file itself (float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_gguf(path)  # a truncated or foreign file is one line, before transformers trips on it
    kwargs = {"gguf_file": path.name, "local_files_only": True}
    extra = {}
    try:  # newer transformers can keep GGUF blocks packed (no dense .weight to read F from): unpack them
        from transformers import GgufConfig

        extra["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older transformers always dequantise
        pass
    try:
        with _our_bar(f"dequantising {path.name}"):
            model = AutoModelForCausalLM.from_pretrained(path.parent, **kwargs, **extra)
        tok = AutoTokenizer.from_pretrained(path.parent, **kwargs)
    except Exception as e:  # transformers raises many kinds here; each becomes one line
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"transformers cannot load or dequantise {path.name}: {why}") from e
    return model, as_the_file_says(tok, path)


_bar_lock = threading.Lock()


class _Tensors:
    """What transformers' GGUF reader takes for tqdm: the tensors, under eigenhooks' bar (``progress``: rich on
    a terminal or in a notebook, nothing when stderr is piped), never tqdm's own on stderr."""

    description = "dequantising"

    def __init__(self, iterable=None, desc=None, total=None, **_):
        self.iterable, self.total = iterable, total

    def __iter__(self):
        return iter(track(self.iterable, self.description, total=self.total))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n=1) -> None:
        pass

    def close(self) -> None:
        pass


@contextmanager
def _our_bar(description: str):
    """transformers' "Converting and de-quantizing GGUF tensors" tqdm bar replaced by ours while the block runs.

    Its GGUF reader calls tqdm itself (``tqdm.auto``), so transformers' disable_progress_bar does not reach it.
    """
    import transformers.modeling_gguf_pytorch_utils as reader

    if not hasattr(reader, "tqdm"):  # a transformers that draws no bar there
        yield
        return
    bar = type("_Bar", (_Tensors,), {"description": description})
    with _bar_lock:
        saved, reader.tqdm = reader.tqdm, bar
        try:
            yield
        finally:
            reader.tqdm = saved


# the GGUF keys of the tokenizer's special tokens, by the tokenizer's attribute
_SPECIAL_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
}


def as_the_file_says(tok, path: Path):
    """The tokenizer with the special tokens and the BOS rule the GGUF file records.

    transformers 4.x builds a GGUF's tokenizer without them: SmolLM2's file says BOS 1, EOS 2, pad 2
    and no BOS prepended, and 4.56 gave EOS 1, no pad and a BOS before every text: a user's
    ``tok(text)`` was other tokens than on 5.x (which follows the file), ``tok(texts, padding=True)``
    failed, and ``tok.eos_token`` named the wrong token. (``eigenhooks run`` encodes without special
    tokens and was not affected.) Where the tokenizer already agrees (5.x), nothing changes.
    """
    meta = metadata_scalars(path, [*_SPECIAL_KEYS.values(), "tokenizer.ggml.add_bos_token"])
    for attr, key in _SPECIAL_KEYS.items():
        i = meta.get(key)
        if i is not None and 0 <= int(i) < len(tok) and getattr(tok, f"{attr}_id", None) != int(i):
            setattr(tok, attr, tok.convert_ids_to_tokens(int(i)))
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    if add_bos is not None and getattr(tok, "add_bos_token", bool(add_bos)) != bool(add_bos):
        tok.add_bos_token = bool(add_bos)  # 4.x's Llama tokenizer rebuilds its post-processor
    return tok


def _convert_into(path: Path, folder: Path) -> None:
    model, tok = _convert(path)
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config  # the saved weights are dense: nothing to unpack on reload
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)


def _load_entry(path: Path, folder: Path, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"local_files_only": True}
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, **kwargs, **({"dtype": dtype} if dtype else {}))
        tok = AutoTokenizer.from_pretrained(folder, **kwargs)
    except Exception as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(
            f"the converted copy of {path.name} at {folder} does not load ({why}); "
            "`eigenhooks cache clear --models` and load again"
        ) from e
    return model, as_the_file_says(tok, path)  # a copy converted before this rule came in is mended too


def _warn_unwritable(e: OSError) -> None:
    if str(e) in _unwritable_warned:
        return
    _unwritable_warned.add(str(e))
    warnings.warn(
        f"{e}; converting the GGUF without the model cache (every load pays it). "
        "Set EIGENHOOKS_CACHE to a writable folder to keep converted models.",
        store.ModelCacheWarning,
        stacklevel=3,
    )
