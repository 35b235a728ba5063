"""eigenhooks: power-method alignment of transformer tokens, measured with forward hooks.

Public API (DESIGN.md §3)::

    import eigenhooks as eh
    specs = eh.spectra(model, variant="ov", rank="modulus")
    eh.verify(model)            # F from the weights vs F from the model's own forward
    model, tok = eh.zoo.load("gpt2-tiny")
"""

from . import direction, planted, zoo
from .api import Verification, spectra, verify
from .dynamics import Limit, Trajectory, classify_limit, iterate, predict_limit
from .metrics import TargetError
from .models import Adapter, UnsupportedModelError, get_adapter, supported_families
from .models.loading import ModelLoadError, load_model
from .monitor import MeasurementWarning, Monitor, monitor
from .spectrum import Factors, HeadSpectrum, LayerSpectrum, layer_spectrum
from .steering import Steer, SteerReport, steer

__version__ = "0.1.0"

__all__ = [
    "Adapter",
    "Factors",
    "ModelLoadError",
    "load_model",
    "HeadSpectrum",
    "LayerSpectrum",
    "UnsupportedModelError",
    "Verification",
    "MeasurementWarning",
    "TargetError",
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
    "supported_families",
    "verify",
    "zoo",
    "__version__",
]
