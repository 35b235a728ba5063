"""The ground: the eigen-core of F = O V and the spectrum cache on disk.

Owns ``Factors`` (a layer's O and V), ``layer_spectrum`` (the float64 eigen-decomposition of F,
through its small side when H*d_head < d), the ranking rules, the gap and the principal basis
(``eig``, ``ranking``), each head's and key/value group's spectrum and OV-circuit copying
(``heads``), a vector's alignment with a subspace (``subspace``), and the cache of spectra keyed by the weights' content (``cache``). Pure torch and
numpy: it imports no other wing of eigenhooks, nor transformers or transformer_lens.
"""

from .cache import cache_dir, cache_key, load_spectrum, save_spectrum, spectrum_files, tensors_digest
from .eig import RANKS, Factors, LayerSpectrum, NonFiniteError, layer_spectrum, rank_scores
from .heads import part_spectra
from .ranking import GroupSpectrum, HeadSpectrum, PartSpectrum
from .subspace import alignment

__all__ = [
    "RANKS",
    "alignment",
    "Factors",
    "GroupSpectrum",
    "HeadSpectrum",
    "LayerSpectrum",
    "NonFiniteError",
    "PartSpectrum",
    "cache_dir",
    "cache_key",
    "layer_spectrum",
    "part_spectra",
    "load_spectrum",
    "rank_scores",
    "save_spectrum",
    "spectrum_files",
    "tensors_digest",
]
