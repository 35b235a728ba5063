"""What the command line shows about itself: readable types in ``--help`` and ``--version``.

typer 0.29 prints an option's Python type as ``<bool>``, ``<str>``, ``<list[str]>``; older typer prints
click's ``TEXT``, ``INTEGER``. ``ReadableTyper`` makes every command print what click prints, under every
typer: a flag shows no type, a value its kind (``TEXT``, ``INTEGER``, ``FLOAT``), an argument its name.
"""

from __future__ import annotations

import re
import typing

import typer

# typer >= 0.24's type labels, as click and older typer print them
KINDS = {"str": "TEXT", "int": "INTEGER", "float": "FLOAT", "Path": "PATH"}


def _label(typed: str | None) -> str | None:
    """'<int>' -> 'INTEGER', '<list[str]>...' -> 'TEXT', '<hf|lens>' -> 'hf|lens'."""
    if not typed:
        return typed
    inner = re.sub(r"^list\[(.*)\]$", r"\1", typed.rstrip(".").strip("<>"))
    return inner if "|" in inner else KINDS.get(inner, inner.upper())


def _plain(param) -> None:
    """A flag shows no type, an option its kind, an argument only its name. Only typer >= 0.24 has
    ``display_type_rich`` (older typer prints click's names already)."""
    if not hasattr(param, "display_type_rich") or param.metavar is not None:
        return
    typed = param.display_type_rich
    if param.param_type_name != "option" or getattr(param, "is_flag", False):
        param.display_type_rich = lambda ctx: None
    else:
        param.display_type_rich = lambda ctx: _label(typed(ctx))


class _Readable:
    def get_params(self, ctx):
        params = super().get_params(ctx)  # the command's own and --help
        for p in params:
            _plain(p)
        return params


class ReadableCommand(_Readable, typer.core.TyperCommand):
    """A command whose --help prints TEXT, INTEGER ..., and no type for a flag."""


class ReadableGroup(_Readable, typer.core.TyperGroup):
    """The app's group, likewise (its --help and --version)."""


class ReadableTyper(typer.Typer):
    """A ``typer.Typer`` whose group and commands print readable types in --help."""

    def __init__(self, **kwargs):
        super().__init__(cls=ReadableGroup, **kwargs)

    def command(self, *args, cls=None, **kwargs):
        return super().command(*args, cls=cls or ReadableCommand, **kwargs)


def print_version(value: bool) -> None:
    """``--version``: eigenhooks' version, then torch's and transformers' (what a bug report needs)."""
    if not value:
        return
    from importlib.metadata import PackageNotFoundError, version

    from ..data import __version__

    found = []
    for dist in ("torch", "transformers"):
        try:
            found.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            found.append(f"{dist} not installed")
    typer.echo(f"eigenhooks {__version__} ({', '.join(found)})")
    raise typer.Exit()


VersionOpt = typing.Annotated[
    bool, typer.Option("--version", help="print the version and exit", callback=print_version, is_eager=True)
]
