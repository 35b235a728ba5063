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

from . import _startup  # noqa: F401  isort: skip  (first, before torch: a Ctrl-C while the command starts is one line)
from . import _moved, zoo
from .dynamics import Limit, Trajectory, classify_limit, iterate, planted, predict_limit
from .linalg import Factors, GroupSpectrum, HeadSpectrum, LayerSpectrum, layer_spectrum
from .models import Adapter, UnsupportedModelError, get_adapter, supported_families
from .steer import direction
from .zoo import ModelLoadError, load_model

# The wings `monitor`, `spectra` and `steer` share their names with the functions below: these
# imports come last so that the names bind to the functions (their packages stay importable
# as `eigenhooks.monitor` etc. through sys.modules).
from .monitor import MeasurementWarning, Monitor, SinkError, TargetError, monitor  # noqa: E402  isort: skip
from .spectra import TokenReadout, Verification, rank_directions, read_tokens, spectra, verify  # noqa: E402  isort: skip
from .steer import Steer, SteerReport, steer  # noqa: E402  isort: skip

_moved.install()

from .data import __version__  # noqa: E402

__all__ = [
    "Adapter",
    "Factors",
    "ModelLoadError",
    "load_model",
    "GroupSpectrum",
    "HeadSpectrum",
    "TokenReadout",
    "LayerSpectrum",
    "UnsupportedModelError",
    "Verification",
    "MeasurementWarning",
    "TargetError",
    "SinkError",
    "Monitor",
    "Steer",
    "Limit",
    "Trajectory",
    "classify_limit",
    "iterate",
    "planted",
    "predict_limit",
    "SteerReport",
    "direction",
    "steer",
    "get_adapter",
    "monitor",
    "layer_spectrum",
    "spectra",
    "rank_directions",
    "read_tokens",
    "supported_families",
    "verify",
    "zoo",
    "__version__",
]


def __getattr__(name: str):
    """``eh.run`` and ``eh.integrations`` (wings imported on first use), and ``eh.metrics``, ``eh.api`` ...:
    old module attributes, through the deprecation table."""
    import importlib

    if name in ("run", "integrations") or f"{__name__}.{name}" in _moved.MOVED:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
