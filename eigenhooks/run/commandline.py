"""What the command line shows about itself: readable types in ``--help``, ``--version``, eigenhooks'
warnings in one line, other libraries kept quiet, and a library message with its arguments named as flags.

typer 0.29 prints an option's Python type as ``<bool>``, ``<str>``, ``<list[str]>``; older typer prints
click's ``TEXT``, ``INTEGER``. ``ReadableTyper`` makes every command print what click prints, under every
typer: a flag shows no type, a value its kind (``TEXT``, ``INTEGER``, ``FLOAT``), an argument its name.
"""

from __future__ import annotations

import contextlib
import re
import sys
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
    from ..data import __version__
    from .checks import installed_version

    found = [f"{dist} {installed_version(dist)}" for dist in ("torch", "transformers")]
    typer.echo(f"eigenhooks {__version__} ({', '.join(found)})")
    raise typer.Exit()


VersionOpt = typing.Annotated[
    bool, typer.Option("--version", help="print the version and exit", callback=print_version, is_eager=True)
]


def one_line_warnings() -> None:
    """eigenhooks' own warnings print as one line on stderr ("eigenhooks: warning: ..."), once each."""
    import warnings

    default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if not (category.__module__.startswith("eigenhooks") or text.startswith("eigenhooks: ")):
            return default(message, category, filename, lineno, file, line)
        typer.echo(f"eigenhooks: warning: {text.removeprefix('eigenhooks: ')}", err=True)  # said once

    warnings.showwarning = show


def quiet_libraries() -> None:
    """Keep transformers' progress bars and warnings, and datasets' log lines, off stdout/stderr
    (tables and JSON stay clean; a file datasets cannot read is our one line, not its log line first)."""
    import os

    os.environ.setdefault("DATASETS_VERBOSITY", "critical")  # read when --dataset first imports datasets
    if "datasets" in sys.modules:
        sys.modules["datasets"].utils.logging.set_verbosity(50)  # logging.CRITICAL
    with contextlib.suppress(ImportError):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()


# library names of a command's inputs that differ from its option's name
_ALIASES = {"steer": {"direction": "--toward"}}


def as_flags(msg: str, cmd, command: str | None) -> str:
    """A library message as a command-line user needs it: the running command's options named
    by their flags, not their Python arguments (``allow_shared=True`` -> ``--allow-shared``,
    ``gap_ratio`` -> ``--gap-ratio``, ``alpha=5.0`` -> ``--alpha 5.0``, ``mode must`` -> ``--mode must``).
    ``cmd`` is the running command's click command, ``command`` its name.

    Plain words (mode, layer, text ...) change only where they are an argument's name: before
    ``=`` or ``must``, or next to another flag (``alpha and --gap-ratio``); words with an
    underscore change everywhere.
    """
    if cmd is None:
        return msg
    flags = {p.name: p.opts[0] for p in cmd.params if p.param_type_name == "option" and p.opts[0][:2] == "--"}
    flags.update(_ALIASES.get(command, {}))
    for name, flag in flags.items():
        n = rf"(?<![-\w.'\"]){re.escape(name)}"
        msg = re.sub(rf"{n}=True\b", flag, msg)
        msg = re.sub(rf"{n}=(?=\S)", flag + " ", msg)
        msg = re.sub(rf"{n}\b(?=\s+must\b)" if "_" not in name else rf"{n}\b", flag, msg)
    for name, flag in flags.items():  # "one of alpha and --gap-ratio", "--alpha or mode"
        n = rf"(?<![-\w.'\"]){re.escape(name)}\b"
        msg = re.sub(rf"{n}(?=,? (?:and|or) --)", flag, msg)
        msg = re.sub(rf"(--[\w-]+,? (?:and|or) ){n}", rf"\g<1>{flag}", msg)
    return msg
