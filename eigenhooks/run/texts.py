"""Text for ``eigenhooks run``: a string, a file, a dataset or the bundled sample, streamed into batches.

Nothing here holds the whole corpus: texts are read lazily (a file paragraph by paragraph,
a dataset through HF datasets' streaming mode) and cut into (batch, seq_len) blocks as
they come, so memory stays flat in the number of tokens.

``--dataset`` takes a local file or folder read offline by HF datasets' own builders
(``data.txt`` -> ``text``, ``data.jsonl`` / ``.json`` -> ``json``, ``.csv``, ``.parquet``;
or explicitly ``text:PATH``, ``json:PATH``, globs allowed), or a hub name ``NAME[:split]``.
Files are read in HF datasets' chunks (10 MB), never whole, with one exception: a ``.json``
file holding one JSON array is parsed whole (use JSON Lines for big corpora). A ``text``
row is one line, its line break kept; blank rows are skipped. The column read is
``text`` if the first row has it, else the first string column.
"""

from __future__ import annotations

import codecs
import itertools
import logging
import warnings
from collections.abc import Iterable, Iterator
from importlib import resources
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


class DataLoadError(RuntimeError):
    """Text or a dataset could not be loaded; the message says why."""


class UnknownTokenWarning(UserWarning):
    """Some words became the tokenizer's unknown token (e.g. WordPiece's [UNK])."""


def sample_text() -> str:
    """The text bundled with the package (passages of Python's documentation)."""
    return resources.files("eigenhooks.data").joinpath("sample.txt").read_text(encoding="utf-8")


def _paragraphs(lines: Iterable[str]) -> Iterator[str]:
    """Blank-line separated paragraphs of a stream of lines, one at a time."""
    para: list[str] = []
    for line in lines:
        if line.strip():
            para.append(line)
        elif para:
            yield "".join(para)
            para = []
    if para:
        yield "".join(para)


def check_utf8(path: Path, chunk: int = 1 << 20) -> None:
    """Raise DataLoadError naming the file and the offset if it is not valid UTF-8 (streamed, O(chunk) memory)."""
    dec = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            try:
                dec.decode(b, final=not b)
            except UnicodeDecodeError as e:
                at = offset + e.start
                raise DataLoadError(
                    f"{path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {at}): "
                    f"convert it, e.g. iconv -f latin1 -t utf-8 {path.name} > {path.stem}.utf8{path.suffix}"
                ) from None
            if not b:
                return
            offset += len(b)


def check_text(text: str, flag: str = "--text") -> str:
    """``text`` if it is text: not blank, and UTF-8 (a bad byte of a command line arrives as a lone surrogate).

    Raises:
        DataLoadError: a blank text, or one holding what is no character, named by byte and offset.
    """
    if not isinstance(text, str):
        raise DataLoadError(f"{flag} must be a string, got {type(text).__name__}")
    try:
        raw = text.encode("utf-8", "surrogateescape")  # the bytes given, if it came from a command line
    except UnicodeEncodeError as e:  # a surrogate no command line makes: a str built in Python
        raise DataLoadError(
            f"{flag} holds the lone surrogate U+{ord(text[e.start]):04X} at character {e.start}, which is no "
            "character: pass text that encodes as UTF-8"
        ) from None
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataLoadError(
            f"{flag} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}): a character cut in half, "
            "or another encoding; convert it, e.g. with iconv -f latin1 -t utf-8, or use --file"
        ) from None
    if not text.strip():
        raise DataLoadError(f"{flag} is blank ({text!r}): give some text, or use --file or --dataset")
    return text


def load_for_text(model: str, text: str):
    """(model, tokenizer, the text's input batch) for ``eigenhooks iterate``: the text checked before the model loads."""
    check_text(text)
    from ..zoo.loading import load_model

    m, tok = load_model(model)
    return m, tok, tok([text], return_tensors="pt")


def iter_texts(text: str | None = None, file: str | None = None, dataset: str | None = None) -> Iterator[str]:
    """Texts from at most one of a string, a file, a dataset; by default the bundled sample.

    Checks (exactly one source, non-blank text, the file exists and is UTF-8, the dataset
    opens) run at once; the texts themselves are read lazily.

    Raises:
        DataLoadError: two sources, a blank ``--text``, a missing or non-UTF-8 file, or a
            dataset that cannot be opened.
    """
    if sum(x is not None for x in (text, file, dataset)) > 1:
        raise DataLoadError("give at most one of --text, --file and --dataset")
    if text is not None:
        return iter([check_text(text)])
    if file is not None:
        p = Path(file).expanduser()
        if p.is_dir():
            raise DataLoadError(
                f"--file {file} is a folder, not a file: name a text file in it (or pass the folder to --dataset)"
            )
        if not p.is_file():
            raise DataLoadError(f"no such file: {file}")
        check_utf8(p)
        return _file_texts(p)
    if dataset is not None:
        return _dataset_texts(dataset)
    return _paragraphs(sample_text().splitlines(keepends=True))


def load_texts(text: str | None = None, file: str | None = None, dataset: str | None = None) -> list[str]:
    """All texts of ``iter_texts`` as a list (small inputs only; ``eigenhooks run`` streams)."""
    return list(iter_texts(text, file, dataset))


def _file_texts(p: Path) -> Iterator[str]:
    with open(p, encoding="utf-8") as f:
        yield from _paragraphs(f)


def _dataset_source(spec: str) -> tuple[str, dict, Path | None]:
    """(builder or hub name, load_dataset kwargs, the local path or None) for a --dataset value.

    Raises:
        DataLoadError: a local file that is missing, empty or of an unknown type.
    """
    head, sep, rest = spec.partition(":")
    if sep and head in set(BUILDERS.values()) and rest:
        p = Path(rest).expanduser()
        if not any(c in rest for c in "*?[") and not p.exists():
            raise DataLoadError(f"--dataset {spec}: no such file or folder: {p}")
        return head, _builder_kwargs(head, p), p
    p = Path(spec).expanduser()
    if p.is_file():
        if p.suffix.lower() not in BUILDERS:
            raise DataLoadError(
                f"--dataset {spec}: unknown file type {p.suffix!r}; use one of {', '.join(BUILDERS)} "
                "or say the builder, e.g. text:PATH"
            )
        if p.stat().st_size == 0:
            raise DataLoadError(f"--dataset {spec}: the file is empty")
        builder = BUILDERS[p.suffix.lower()]
        return builder, _builder_kwargs(builder, p), p
    if p.is_dir():
        return str(p), {"split": "train"}, p
    if p.suffix.lower() in BUILDERS:  # looks like a file, is not one: not a hub name
        raise DataLoadError(f"--dataset {spec}: no such file: {p}")
    name, _, split = spec.partition(":")
    return name, {"split": split or "train"}, None


def _builder_kwargs(builder: str, p: Path) -> dict:
    """load_dataset kwargs for one local file (or glob); text keeps each line's line break."""
    kwargs = {"data_files": str(p), "split": "train"}
    if builder == "text":
        kwargs["keep_linebreaks"] = True  # lines joined as in the file, not run together
    return kwargs


def _dataset_texts(spec: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError as e:
        raise DataLoadError("--dataset needs the 'datasets' package: pip install datasets") from e
    name, kwargs, local = _dataset_source(spec)
    try:
        rows = iter(datasets.load_dataset(name, streaming=True, **kwargs))
        first = next(rows, None)
    except Exception as e:  # offline, unknown name, bad split, unreadable file: one clear line
        raise _load_error(spec, name, local, e) from e
    if first is None:
        raise DataLoadError(f"dataset {spec!r} has no rows")
    col = _text_column(spec, first)
    return _rows(spec, name, local, itertools.chain([first], rows), col)


def _text_column(spec: str, first: dict) -> str:
    """'text' if the first row has a string 'text', else its first string column."""
    cols = [c for c, v in first.items() if isinstance(v, str)]
    if not cols:
        kinds = ", ".join(f"{c}: {type(v).__name__}" for c, v in first.items())
        raise DataLoadError(
            f"dataset {spec!r} has no text column: its first row holds {kinds or 'nothing'}; "
            'give rows with a string field, e.g. {"text": "..."} per line of a .jsonl'
        )
    col = "text" if "text" in cols else cols[0]
    logger.info("dataset %r: reading column %r (string columns: %s)", spec, col, ", ".join(cols))
    return col


def _rows(spec: str, name: str, local: Path | None, rows: Iterator[dict], col: str) -> Iterator[str]:
    """The non-blank strings of column ``col``, row by row; a read error later in the file names it."""
    try:
        for row in rows:
            v = row.get(col)
            if isinstance(v, str) and v.strip():
                yield v
    except Exception as e:  # e.g. a malformed line 10 MB into a .jsonl: say which file
        raise _load_error(spec, name, local, e) from e


def _load_error(spec: str, name: str, local: Path | None, e: Exception) -> DataLoadError:
    why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    if local is not None:
        how = f"with the {name!r} builder" if name in BUILDERS.values() else "as a dataset folder"
        return DataLoadError(f"could not read {local} {how} ({type(e).__name__}: {why})")
    return DataLoadError(
        f"could not load dataset {spec!r} ({type(e).__name__}: {why}); offline? "
        "give a local file (--dataset data.txt / data.jsonl) or use --file"
    )


class TokenBatches:
    """(batch, seq_len) blocks of real tokens (no padding), cut from a stream of texts as it comes.

    Texts are tokenized one at a time and joined; full sequences are grouped
    ``batch_size`` at a time; the remainder (shorter than seq_len) comes last as its own
    (1, r) batch. At most ``max_tokens`` tokens are taken. After iterating,
    ``n_tokens`` and ``n_unknown`` (tokens that became the tokenizer's unknown token) are set.

    Args:
        tokenizer: an HF tokenizer.
        texts: any iterable of strings (consumed lazily).
        max_tokens, seq_len, batch_size: positive integers.
    """

    def __init__(self, tokenizer, texts: Iterable[str], max_tokens: int, seq_len: int, batch_size: int):
        for name, v in (("max_tokens", max_tokens), ("seq_len", seq_len), ("batch_size", batch_size)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        self.tokenizer, self.texts = tokenizer, texts
        self.max_tokens, self.seq_len, self.batch_size = max_tokens, seq_len, batch_size
        self.n_tokens = 0
        self.n_unknown = 0
        self._unk = _unknown_id(tokenizer)
        self._ahead: list[list[int]] = []  # texts tokenized by ``count``, not yet batched

    def __repr__(self) -> str:
        return (
            f"TokenBatches(max_tokens={self.max_tokens}, seq_len={self.seq_len}, batch_size={self.batch_size}, "
            f"{self.n_tokens} tokens so far)"
        )

    def count(self) -> int:
        """How many tokens the batches will hold: the texts' tokens, at most ``max_tokens``. Tokenizes the
        texts ahead (only as far as ``max_tokens`` reaches; iterating then uses them), so a progress bar
        can show the real total."""
        n, texts = 0, iter(self.texts)
        while n < self.max_tokens:
            t = next(texts, None)
            if t is None:
                break
            self._ahead.append(self.tokenizer(t, add_special_tokens=False)["input_ids"])
            n += len(self._ahead[-1])
        self.texts = texts  # what is left, read lazily as before
        return min(n, self.max_tokens)

    def _ids(self) -> Iterator[list[int]]:
        """Each text's token ids: those ``count`` tokenized first, then the rest as they come."""
        while self._ahead:
            yield self._ahead.pop(0)
        for t in self.texts:
            yield self.tokenizer(t, add_special_tokens=False)["input_ids"]

    def __iter__(self) -> Iterator[torch.Tensor]:
        buf: list[int] = []  # tokens not yet in a batch: < batch_size * seq_len + one text
        block = self.batch_size * self.seq_len
        for ids in self._ids():
            ids = ids[: self.max_tokens - self.n_tokens]
            self.n_tokens += len(ids)
            if self._unk is not None:
                self.n_unknown += sum(i == self._unk for i in ids)
            buf.extend(ids)
            while len(buf) >= block:
                yield torch.tensor(buf[:block]).view(self.batch_size, self.seq_len)
                del buf[:block]
            if self.n_tokens >= self.max_tokens:
                break
        if not self.n_tokens:
            raise DataLoadError("the text is empty after tokenization")
        full = len(buf) // self.seq_len * self.seq_len
        if full:
            yield torch.tensor(buf[:full]).view(-1, self.seq_len)
        if full < len(buf):
            yield torch.tensor([buf[full:]])  # the remainder, as its own batch

    def warn_unknown(self, what: str = "the text") -> None:
        """Warn (UnknownTokenWarning) if any token became the tokenizer's unknown token."""
        if self.n_unknown:
            tok = self.tokenizer.unk_token
            warnings.warn(
                f"{self.n_unknown} of {self.n_tokens} tokens of {what} became {tok} (words missing from the "
                f"tokenizer's vocabulary); they are measured as {tok}",
                UnknownTokenWarning,
                stacklevel=2,
            )


def _unknown_id(tokenizer) -> int | None:
    """The unknown token's id, unless it doubles as a real special token (GPT-2's <|endoftext|>)."""
    unk = getattr(tokenizer, "unk_token", None)
    if unk is None or unk in {getattr(tokenizer, a, None) for a in ("eos_token", "bos_token", "pad_token")}:
        return None
    return tokenizer.convert_tokens_to_ids(unk)


def make_batches(tokenizer, texts: Iterable[str], max_tokens: int, seq_len: int, batch_size: int) -> list[torch.Tensor]:
    """All batches of ``TokenBatches`` as a list (for tests and small inputs)."""
    return list(TokenBatches(tokenizer, texts, max_tokens, seq_len, batch_size))
