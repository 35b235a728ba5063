"""Is this a whole GGUF file? A walk over its header, so that a bad file is one line, not a traceback.

transformers' reader assumes a well-formed file: a 100-byte file fails with "unpack_from requires
a buffer ...", one cut inside its tensors with "cannot reshape array ...". ``check_gguf(path)``
reads the header the way the format defines it (magic, version, metadata, tensor table), checks
that every read stays inside the file and that every tensor's bytes are there, and raises
``ModelLoadError`` naming the file and what is wrong. It reads only the header (tens of
milliseconds on a 100 MB file); the tensor bytes are never touched.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from .errors import ModelLoadError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # what transformers reads (v1 used 32-bit counts)
AGAIN = "fetch, download or copy it again"
# GGUF metadata value types -> struct format of one value (8 string, 9 array: read apart)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
MAX_DIMS = 8


class _Short(Exception):
    """A read ran past the end of the file."""


class _Cursor:
    """Little-endian reads over a buffer that say what they were reading when the file ends."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise _Short
        (v,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return v

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise _Short
        self.pos += n

    def string(self) -> bytes:
        n = self.take("Q")
        start = self.pos
        self.skip(n)
        return bytes(self.buf[start : start + min(n, 200)])


def check_gguf(path) -> None:
    """Raise ModelLoadError unless ``path`` is a whole GGUF file of a version transformers reads.

    Args:
        path: the file.

    Raises:
        ModelLoadError: no such file, a folder, an unreadable, empty, non-GGUF, unsupported-version,
            truncated or inconsistent file; the message names the file and says what is wrong.
    """
    path = Path(path)
    name = path.name
    if path.is_dir():
        raise ModelLoadError(f"{path} is a folder, not a GGUF file")
    try:
        size = path.stat().st_size
        if size == 0:
            raise ModelLoadError(f"{path} is empty (0 bytes), not a GGUF model: {AGAIN}")
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            _check_magic(path, buf[:8])
            _walk(name, path, _Cursor(buf), size)
    except FileNotFoundError as e:
        raise ModelLoadError(f"no GGUF file at {str(path)!r}") from e
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror or e}") from e


def metadata_scalars(path, keys) -> dict[str, object]:
    """The scalar metadata values of ``keys`` that a GGUF file holds (a key it lacks is left out).

    Reads only the metadata (milliseconds; ``gguf.GGUFReader`` takes seconds on a 100 MB file, as it
    parses every token and tensor). Call it on a file ``check_gguf`` has passed.
    """
    wanted, out = {k.encode() for k in keys}, {}
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        c = _Cursor(buf)
        c.skip(16)  # magic, version, tensor count
        for _ in range(c.take("Q")):
            key = c.string()
            vtype = c.take("I")
            value = _value(c, vtype, Path(path), "metadata")
            if key in wanted and vtype in SCALARS:
                out[key.decode()] = value
    return out


def check_magic(path) -> None:
    """The cheap part of ``check_gguf``: a non-empty file that starts with a GGUF header of a known version."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
    except IsADirectoryError as e:
        raise ModelLoadError(f"{path} is a folder, not a GGUF file") from e
    except FileNotFoundError as e:
        raise ModelLoadError(f"no GGUF file at {str(path)!r}") from e
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror or e}") from e
    if not head:
        raise ModelLoadError(f"{path} is empty (0 bytes), not a GGUF model: {AGAIN}")
    _check_magic(path, head)


def _check_magic(path: Path, head: bytes) -> None:
    if head[:4] != MAGIC:
        raise ModelLoadError(
            f"{path} is not a GGUF file: it begins with {head[:4]!r}, a GGUF file with {MAGIC!r}"
            + (f" (and it is only {len(head)} bytes long)" if len(head) < 4 else "")
        )
    if len(head) < 8:
        raise ModelLoadError(f"{path} is cut short: {len(head)} bytes, not even a GGUF header: {AGAIN}")
    (version,) = struct.unpack_from("<I", head, 4)
    if version not in VERSIONS:
        raise ModelLoadError(
            f"{path} says GGUF version {version}; transformers reads versions 2 and 3 "
            "(the file is damaged, big-endian, or from an old writer)"
        )


def _walk(name: str, path: Path, c: _Cursor, size: int) -> None:
    """Read the metadata and the tensor table; every tensor's bytes must lie inside the file."""
    where = "the header"
    try:
        c.skip(8)
        n_tensors, n_kv = c.take("Q"), c.take("Q")  # a damaged count ends in _Short: each entry takes bytes
        alignment = 32
        for i in range(n_kv):
            where = f"metadata entry {i + 1} of {n_kv}"
            key = c.string()
            where += f" ({key.decode('utf-8', 'replace')!r})"
            vtype = c.take("I")
            value = _value(c, vtype, path, where)
            if key == b"general.alignment" and isinstance(value, int) and value > 0:
                alignment = value
        tensors = []
        for i in range(n_tensors):
            where = f"the tensor table (entry {i + 1} of {n_tensors})"
            tname = c.string().decode("utf-8", "replace")
            n_dims = c.take("I")
            if n_dims > MAX_DIMS:
                raise ModelLoadError(f"{path} is damaged: tensor {tname!r} has {n_dims} dimensions")
            dims = [c.take("Q") for _ in range(n_dims)]
            tensors.append((tname, dims, c.take("I"), c.take("Q")))
    except _Short:
        raise ModelLoadError(f"{path} is cut short: its {size} bytes end inside {where}: {AGAIN}") from None
    if not tensors:
        raise ModelLoadError(f"{path} is a GGUF file with no tensors ({n_kv} metadata keys): not a model")
    data = -(-c.pos // alignment) * alignment  # the tensor data starts at the next aligned offset
    _check_tensors(path, tensors, data, size)


def _value(c: _Cursor, vtype: int, path: Path, where: str):
    if vtype in SCALARS:
        return c.take(SCALARS[vtype])
    if vtype == STRING:
        return c.string()
    if vtype == ARRAY:
        etype, n = c.take("I"), c.take("Q")
        if etype in SCALARS:
            c.skip(n * struct.calcsize("<" + SCALARS[etype]))
        elif etype == STRING:
            if n * 8 > len(c.buf) - c.pos:
                raise _Short
            for _ in range(n):
                c.skip(c.take("Q"))
        else:  # nested arrays: llama.cpp writes none; read them the generic way
            for _ in range(n):
                _value(c, etype, path, where)
        return None
    raise ModelLoadError(f"{path} is damaged: {where} has unknown value type {vtype}")


def _check_tensors(path: Path, tensors: list, data: int, size: int) -> None:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    end_max, last = data, None
    for tname, dims, ttype, offset in tensors:
        try:
            block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        except (ValueError, KeyError):
            raise ModelLoadError(f"{path} has tensor {tname!r} of unknown type {ttype}: damaged or too new") from None
        n = 1
        for d in dims:
            n *= d
        if n % block:
            raise ModelLoadError(f"{path} is damaged: tensor {tname!r} has {n} values, not a multiple of {block}")
        end = data + offset + n // block * nbytes
        if end > end_max:
            end_max, last = end, tname
    if end_max > size:
        raise ModelLoadError(
            f"{path} is cut short: {size} bytes, but its tensors need {end_max} "
            f"(tensor {last!r} runs past the end): {AGAIN}"
        )
