"""Read a serving engine's checkpoint: the folder it loaded, and named tensors from its safetensors files.

A ``vllm.LLM``'s own weights cannot be read as they stand (merged, sharded, repacked by the CPU
backend), so ``spectra`` reads F's weights from the checkpoint the engine loaded: a local folder, or a
hub id that vLLM downloaded into the HuggingFace cache (found there offline, never fetched). Only the
tensors asked for are read (``safe_open``), so a large checkpoint is never loaded whole. Pickled
``.bin`` checkpoints are refused: eigenhooks loads no pickle.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .errors import ModelLoadError


def checkpoint_folder(model: str, revision: str | None = None, download_dir: str | None = None) -> Path:
    """The local folder holding ``model``'s checkpoint: the folder itself, or its HF-cache snapshot.

    Raises:
        ModelLoadError: neither a folder nor a hub id present in the local cache.
    """
    p = Path(model).expanduser()
    if p.is_dir():
        return p.resolve()
    try:
        from huggingface_hub import snapshot_download

        found = snapshot_download(
            model,
            revision=revision,
            cache_dir=download_dir,
            local_files_only=True,
            allow_patterns=["*.json", "*.safetensors"],
        )
    except Exception as e:
        raise ModelLoadError(
            f"cannot find the checkpoint {model!r} the engine loaded: not a folder, and not in the local HF cache "
            f"({type(e).__name__}); build the engine from a local folder (LLM(model='/path/to/folder'))"
        ) from e
    return Path(found)


def read_config(folder: Path) -> dict:
    """config.json of a checkpoint folder as a dict."""
    try:
        return json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{folder} has no config.json; is it a saved checkpoint folder?") from None


def _files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in folder.glob("*.bin"))
        why = f"only pickled weights ({', '.join(pickled[:3])})" if pickled else "no weights"
        raise ModelLoadError(
            f"{folder} has {why}; eigenhooks reads safetensors only (save the model with save_pretrained, "
            "safe_serialization=True)"
        )
    return files


def read_tensors(folder: Path, names: list[str], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """{name: tensor} for each name, read from the folder's safetensors files and cast to ``dtype``.

    A name matches the stored key equal to it or ending in ``"." + name`` (so ``layers.0.self_attn.
    v_proj.weight`` finds ``model.layers.0.self_attn.v_proj.weight`` and a multimodal model's
    ``language_model.model.layers...``); two stored keys matching one name is an error.

    Raises:
        ModelLoadError: a name found in no file, or in two keys (both named), or no safetensors files.
    """
    from safetensors import safe_open

    where: dict[str, tuple[Path, str]] = {}
    wanted = set(names)
    for f in _files(folder):
        with safe_open(f, framework="pt") as st:
            for key in st.keys():
                hit = key if key in wanted else _suffix_hit(key, wanted)
                if hit is None:
                    continue
                if hit in where:
                    raise ModelLoadError(
                        f"{folder}: two tensors match {hit!r}: {where[hit][1]!r} and {key!r}; pass the checkpoint "
                        "of one model"
                    )
                where[hit] = (f, key)
    missing = [n for n in names if n not in where]
    if missing:
        raise ModelLoadError(
            f"{folder}: no tensor named {missing[0]!r} (or ending in it) in {len(_files(folder))} safetensors "
            f"file(s) ({len(missing)} missing); the checkpoint does not match its declared architecture"
        )
    out = {}
    for n in names:
        f, key = where[n]
        with safe_open(f, framework="pt") as st:
            t = st.get_tensor(key)
        out[n] = t if dtype is None else t.to(dtype)
    return out


def _suffix_hit(key: str, wanted: set[str]) -> str | None:
    """The wanted name that ``key`` ends with after a dot, or None."""
    parts = key.split(".")
    for k in range(1, len(parts)):
        tail = ".".join(parts[k:])
        if tail in wanted:
            return tail
    return None


def drop_resident(tensors) -> int:
    """Give the kernel back this process's resident pages of ``tensors`` that map a file and were never
    written (a safetensors file ``read_tensors`` left mapped, read in the stored dtype; a map with no
    private copy of any page): they stay valid, a page read again being faulted back in from the page
    cache. Anything else (a tensor in anonymous memory, a map with a page written) is left alone. Linux
    only; elsewhere, nothing. Each map holding one of the tensors is given back whole (the pages the kernel
    mapped around them too). Returns the resident bytes given back.

    Why: building a plan reads every byte of the attention weights (their digest, F); afterwards a
    monitor of an engine never reads them again, yet they would count in the process's RSS for as long as
    the adapter lives (a checkpoint's V and O: 10 % of SmolLM2's).
    """
    import ctypes

    try:
        with open("/proc/self/smaps") as fh:
            lines = fh.read().splitlines()
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return 0
    files, here, rss = {}, None, 0  # (start, end) -> resident bytes, of file maps with no page written (no copy)
    for line in lines:
        parts = line.split()
        if parts and "-" in parts[0] and not parts[0].endswith(":"):  # a header: range perms offset dev inode path
            here = parts[0] if len(parts) >= 6 and parts[5].startswith("/") else None
        elif here is not None and parts[:1] == ["Rss:"]:
            rss = int(parts[1]) * 1024
        elif here is not None and parts[:1] == ["Anonymous:"] and parts[1] == "0":
            files[tuple(int(x, 16) for x in here.split("-"))] = rss
    maps = set()  # each clean map holding one of the tensors, whole: safetensors maps the whole file for each
    for t in tensors:  # tensor read, and the kernel maps pages around each page read (fault-around, ~64 KB)
        if t.device.type != "cpu" or t.numel() == 0:
            continue
        lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        maps.update((a, b) for a, b in files if a <= lo and hi <= b)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = 0
    for a, b in sorted(maps):
        if madvise(a, b - a, 4) == 0:  # MADV_DONTNEED: a clean private file map's pages are read back on use
            done += files[(a, b)]
    return done
