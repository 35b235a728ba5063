"""A corpus of independent documents that every machine has: the docstrings of CPython's standard library.

Held-out text for replication (docs/findings.md, "Does it replicate?") must be independent documents, named and
pinned, that install from nowhere: the standard library's own docstrings are on every Python. A document is one
docstring (a module's, a class's or a function's) of at least ``min_chars`` characters, read with ``ast`` (nothing
is imported, so no module's side effects run), in sorted file order, exact duplicates dropped. Its name is
``path:qualname``; ``split`` sends each document to a half by a seeded hash of that name, so the halves do not
depend on the order the documents are listed in. ``digest`` pins the corpus: the same Python gives the same digest.
"""

from __future__ import annotations

import ast
import hashlib
import sys
import sysconfig
from pathlib import Path
from typing import NamedTuple

# the test suites and vendored packages are not the library's prose
_SKIP = ("site-packages", "test/", "idlelib/idle_test", "lib2to3/tests", "tkinter/test", "unittest/test")


class Doc(NamedTuple):
    """One document: ``name`` (``path:qualname``, unique) and its ``text``."""

    name: str
    text: str


def stdlib_docstrings(min_chars: int = 300, root: str | Path | None = None) -> list[Doc]:
    """The standard library's docstrings of at least ``min_chars`` characters, as documents, in a fixed order.

    Args:
        min_chars: the shortest docstring kept (300 characters is about 64 tokens of SmolLM2's tokenizer).
        root: the standard library's folder (default: this interpreter's).

    Returns:
        list of ``Doc``, sorted by file then by position in the file; a text already seen is dropped.
    """
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out, seen = [], set()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(_SKIP) or "/tests/" in rel:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for qual, node in _documented(tree):
            text = ast.get_docstring(node)
            if text and len(text) >= min_chars and text not in seen:
                seen.add(text)
                out.append(Doc(f"{rel}:{qual}", text))
    return out


def _documented(tree: ast.Module, prefix: str = ""):
    """(qualname, node) of the module and of every class and function in it, depth first, in source order."""
    if not prefix:
        yield "<module>", tree
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            qual = f"{prefix}{node.name}"
            yield qual, node
            yield from _documented(node, qual + ".")


def split(docs: list[Doc], seed: int = 0, parts: int = 2) -> list[list[Doc]]:
    """The documents in ``parts`` disjoint parts by a seeded hash of each name (order kept within a part)."""
    out: list[list[Doc]] = [[] for _ in range(parts)]
    for d in docs:
        h = hashlib.sha256(f"{seed}:{d.name}".encode()).digest()
        out[int.from_bytes(h[:8], "little") % parts].append(d)
    return out


def digest(docs: list[Doc]) -> str:
    """A sha256 (16 hex digits) of the documents' names and texts, in order: the corpus's pin."""
    h = hashlib.sha256()
    for d in docs:
        h.update(d.name.encode() + b"\0" + d.text.encode() + b"\0")
    return h.hexdigest()[:16]


def describe(docs: list[Doc]) -> str:
    """One line naming the corpus: what it is, the Python it came from, its size and digest."""
    v = sys.version_info
    return f"CPython {v.major}.{v.minor}.{v.micro} standard-library docstrings: {len(docs)} documents, digest {digest(docs)}"
