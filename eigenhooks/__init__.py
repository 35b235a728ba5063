"""eigenhooks: power-method alignment of transformer tokens, measured with forward hooks.

Public API (docs/design.md, "Public API")::

    import eigenhooks as eh
    specs = eh.spectra(model, variant="ov", rank="modulus")
    eh.verify(model)            # F from the weights vs F from the model's own forward
    model, tok = eh.zoo.load("gpt2-tiny")

The package is laid out in wings, each a subpackage that says in its docstring what it owns,
on a ladder whose imports point down only (docs/design.md, "Architecture"):
``cli`` -> ``run`` -> (``monitor``, ``steer``, ``dynamics``) -> ``spectra`` -> ``zoo`` ->
``models`` -> ``linalg``.
"""

import importlib
import sys
import types
import warnings

from .data import __version__

# Each public name and the module that defines it (None: the name is that module). Nothing is
# imported until a name is first used, so `import eigenhooks` costs nothing and the command's own
# start-up (cli.py) runs before torch is loaded.
_PUBLIC = {
    "Adapter": "eigenhooks.models",
    "Factors": "eigenhooks.linalg",
    "GroupSpectrum": "eigenhooks.linalg",
    "HeadSpectrum": "eigenhooks.linalg",
    "LayerSpectrum": "eigenhooks.linalg",
    "layer_spectrum": "eigenhooks.linalg",
    "UnsupportedModelError": "eigenhooks.models",
    "get_adapter": "eigenhooks.models",
    "supported_families": "eigenhooks.models",
    "ModelLoadError": "eigenhooks.zoo",
    "load_model": "eigenhooks.zoo",
    "zoo": None,
    "Limit": "eigenhooks.dynamics",
    "Trajectory": "eigenhooks.dynamics",
    "classify_limit": "eigenhooks.dynamics",
    "iterate": "eigenhooks.dynamics",
    "predict_limit": "eigenhooks.dynamics",
    "planted": None,  # eigenhooks.dynamics.planted
    "MeasurementWarning": "eigenhooks.monitor",
    "Measure": "eigenhooks.monitor",
    "Monitor": "eigenhooks.monitor",
    "SinkError": "eigenhooks.monitor",
    "TargetError": "eigenhooks.monitor",
    "monitor": "eigenhooks.engines.dispatch",  # a vllm.LLM gets the engine monitor, any other model facade.monitor
    "TokenReadout": "eigenhooks.spectra",
    "Verification": "eigenhooks.spectra",
    "rank_directions": "eigenhooks.spectra",
    "read_tokens": "eigenhooks.spectra",
    "spectra": "eigenhooks.spectra",
    "verify": "eigenhooks.spectra",
    "Steer": "eigenhooks.steer",
    "SteerReport": "eigenhooks.steer",
    "steer": "eigenhooks.steer",
    "direction": None,  # eigenhooks.steer.direction
    "run": None,  # the main job's wing
    "integrations": None,
}
_MODULES = {"planted": "eigenhooks.dynamics.planted", "direction": "eigenhooks.steer.direction"}

# Old flat module paths, reachable one release more as attributes (``eh.metrics``) with a warning.
_MOVED = {
    "api": "eigenhooks.spectra.compute",
    "spectrum": "eigenhooks.linalg.eig",
    "io": "eigenhooks.linalg.cache",
    "metrics": "eigenhooks.monitor.stats",
    "monitor_state": "eigenhooks.monitor.accumulate",
    "monitor_lens": "eigenhooks.models.calls",
    "reducer": "eigenhooks.monitor.reduce",
    "distributed": "eigenhooks.run.distributed",
    "steering": "eigenhooks.steer.edit",
    "rank1": "eigenhooks.steer.rank1",
    "rundir": "eigenhooks.run.folder",
    "report": "eigenhooks.run.report",
    "table": "eigenhooks.run.table",
    "texts": "eigenhooks.run.texts",
}

# `monitor`, `spectra` and `steer` are wings and functions: the package attribute is the function.
_FUNCTIONS = frozenset({"monitor", "spectra", "steer"})


def __getattr__(name: str):
    """A public name, imported on first use; or an old module path, with a DeprecationWarning."""
    if name in _PUBLIC:
        where = _PUBLIC[name]
        if where is None:
            value = importlib.import_module(_MODULES.get(name, f"{__name__}.{name}"))
        else:
            value = getattr(importlib.import_module(where), name)
        globals()[name] = value
        return value
    if name in _MOVED:
        new = _MOVED[name]
        warnings.warn(
            f"{__name__}.{name} moved to {new}; import it from there ({__name__}.{name} is removed in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(new)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """The package: importing the wing ``eigenhooks.monitor`` (or ``spectra``, ``steer``) leaves
    ``eh.monitor`` the function (the wing stays in sys.modules)."""

    def __setattr__(self, name, value):
        if name in _FUNCTIONS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = [n for n in _PUBLIC if n not in ("run", "integrations")] + ["__version__"]
