"""eigenhooks: power-method alignment of transformer tokens, measured with forward hooks.

Public API (docs/design.md, "Public API")::

    import eigenhooks as eh
    specs = eh.spectra(model, variant="ov", rank="modulus")
    eh.verify(model)            # F from the weights vs F from the model's own forward
    model, tok = eh.zoo.load("gpt2-tiny")

The package is laid out in wings, each a subpackage that says in its docstring what it owns,
on a ladder whose imports point down only (docs/design.md, "Architecture"):
``cli -> (run, integrations) -> (monitor, steer, dynamics) -> plots -> spectra -> zoo -> models -> linalg
-> (data, progress)``.
"""

import importlib

from .data import __version__

# Each public name and the module that defines it (None: the name is that module). Nothing is
# imported until a name is first used, so `import eigenhooks` costs nothing and the command's own
# start-up (cli.py) runs before torch is loaded. `monitor`, `spectra` and `steer` are wings that are
# callable: ``eh.monitor(model)`` calls the wing, which is the function ``eigenhooks.monitor.monitor``
# (each wing's __init__.py), so one name is one thing and ``import eigenhooks.monitor.reduce`` works.
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
    "monitor": None,  # the wing, callable (a serving engine gets its own monitor: models.engines)
    "TokenReadout": "eigenhooks.spectra",
    "Verification": "eigenhooks.spectra",
    "rank_directions": "eigenhooks.spectra",
    "read_tokens": "eigenhooks.spectra",
    "spectra": None,  # the wing, callable
    "verify": "eigenhooks.spectra",
    "Steer": "eigenhooks.steer",
    "SteerReport": "eigenhooks.steer",
    "steer": None,  # the wing, callable
    "direction": None,  # eigenhooks.steer.direction
    "run": None,  # the main job's wing
    "integrations": None,
}
_MODULES = {"planted": "eigenhooks.dynamics.planted", "direction": "eigenhooks.steer.direction"}


def __getattr__(name: str):
    """A public name, imported on first use."""
    if name in _PUBLIC:
        where = _PUBLIC[name]
        if where is None:
            value = importlib.import_module(_MODULES.get(name, f"{__name__}.{name}"))
        else:
            value = getattr(importlib.import_module(where), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted((set(globals()) | set(__all__)) - {"importlib", "sys", "types", "warnings"})  # names, not tools


__all__ = [n for n in _PUBLIC if n not in ("run", "integrations")] + ["__version__"]
