"""Old deep import paths, kept working for one release with a DeprecationWarning.

Before 0.2 eigenhooks was 21 flat modules. Code written then (``from eigenhooks.metrics import
alignment``, ``eh.api.clear_memo()``) still runs: importing an old path returns the module that
now holds its code (the same object, so monkeypatching it patches the real thing) and warns
once with the new path. One table and one import hook, instead of a stub file per old module,
so that the package's top level shows only the wings.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from pathlib import Path

MOVED = {
    "eigenhooks.api": "eigenhooks.spectra.compute",
    "eigenhooks.spectrum": "eigenhooks.linalg.eig",
    "eigenhooks.io": "eigenhooks.linalg.cache",
    "eigenhooks.metrics": "eigenhooks.monitor.stats",
    "eigenhooks.monitor_state": "eigenhooks.monitor.accumulate",
    "eigenhooks.monitor_lens": "eigenhooks.monitor.lens",
    "eigenhooks.reducer": "eigenhooks.monitor.reduce",
    "eigenhooks.distributed": "eigenhooks.run.distributed",
    "eigenhooks.steering": "eigenhooks.steer.edit",
    "eigenhooks.rank1": "eigenhooks.steer.rank1",
    "eigenhooks.direction": "eigenhooks.steer.direction",
    "eigenhooks.planted": "eigenhooks.dynamics.planted",
    "eigenhooks.rundir": "eigenhooks.run.folder",
    "eigenhooks.report": "eigenhooks.run.report",
    "eigenhooks.run.plots": "eigenhooks.plots.figures",
    "eigenhooks.table": "eigenhooks.run.table",
    "eigenhooks.texts": "eigenhooks.run.texts",
    "eigenhooks.models.loading": "eigenhooks.zoo.loading",
}


_INTERNAL = (__file__, str(Path(__file__).with_name("__init__.py")))


def warn(old: str, new: str) -> None:
    """A DeprecationWarning attributed to the user's line that imported the old path."""
    frame, level = sys._getframe(0), 1
    while frame is not None and (frame.f_code.co_filename in _INTERNAL or "importlib" in frame.f_code.co_filename):
        # warnings skips the import system's bootstrap frames by itself when it counts stacklevel
        level += not ("importlib" in frame.f_code.co_filename and "_bootstrap" in frame.f_code.co_filename)
        frame = frame.f_back
    warnings.warn(
        f"{old} moved to {new}; import it from there ({old} is removed in the next release)",
        DeprecationWarning,
        stacklevel=level,
    )


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the module that now holds its code."""

    def __init__(self) -> None:
        self._specs: dict = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        warn(spec.name, new)
        module = importlib.import_module(new)
        self._specs[spec.name] = module.__spec__  # the import system overwrites it with the alias's
        return module

    def exec_module(self, module) -> None:
        # The new module ran when it was imported; give it back its own spec (name, file, loader).
        module.__spec__ = self._specs.pop(module.__spec__.name)


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
