"""Progress for steps that can take more than a few seconds (steering's calibration, verify, spectra
of many layers, a GGUF conversion): a rich bar on stderr when a person is watching (a terminal or a
notebook), nothing when stderr is piped, so `--json` output and logs stay clean.

Every caller takes a ``progress`` switch: ``None`` (the default) decides by where stderr goes,
``True`` and ``False`` force it. ``EIGENHOOKS_PROGRESS=0`` turns every bar off. This wing sits at
the bottom of the import ladder: it imports nothing of eigenhooks, so any wing may use it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

__all__ = ["Bar", "bar", "shown", "track"]


def _in_notebook() -> bool:
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def shown(progress: bool | None = None) -> bool:
    """Whether a bar is drawn: ``progress`` if given, else stderr is a terminal or this is a notebook."""
    if os.environ.get("EIGENHOOKS_PROGRESS", "").strip() in ("0", "false", "no", "off"):
        return False
    if progress is not None:
        return bool(progress)
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty()) or _in_notebook()


class Bar:
    """One task of a rich bar, or nothing: ``advance(n)`` and ``update(completed=...)`` either way."""

    def __init__(self, bar=None, task=None):
        self._bar, self._task = bar, task

    @property
    def on(self) -> bool:
        """Whether a bar is drawn (callers may then work in smaller steps, to move it)."""
        return self._bar is not None

    def advance(self, n: float = 1) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def update(self, *, completed: float | None = None, description: str | None = None) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=completed, description=description)


@contextmanager
def bar(description: str, total: float | None, progress: bool | None = None) -> Iterator[Bar]:
    """A transient bar on stderr while the block runs (nothing if not ``shown(progress)``).

    Example:
        >>> with bar("spectra", total=3, progress=False) as b:
        ...     for _ in range(3):
        ...         b.advance()
    """
    if not shown(progress):
        yield Bar()
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as p:
        yield Bar(p, p.add_task(description, total=total))


def track(items: Iterable, description: str, total: float | None = None, progress: bool | None = None):
    """Yield ``items`` one by one, advancing a bar (see ``bar``) after each."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)
    with bar(description, total, progress) as b:
        for x in items:
            yield x
            b.advance()
