"""The streaming reduction: one forward's readings to sums on the device, in two stages.

1. ``projection.project`` runs in a layer's hook, while its activations are hot: norms, one
   matmul per reading point onto the targets (every token) and one onto the nulls (a subsample,
   ``grid.Grid.sub``), and each sequence's sum of unit vectors, written into the layer's row of its
   group's ``arena.Arena``.
2. ``stacked.reduce_many`` runs once the forward ends, on every layer at once: layers of one layout
   are reduced together straight from the arena's buffers.

A flush of buffered one-token steps takes stage 1 for every layer at once instead
(``batched.project_layers``: the slots' norms and null gathers in one op each, the matmuls written
into the stacked buffers; one bmm a reading point on CUDA).

``bases`` lays out each layer's bases, ``kernels`` holds the float32-accumulating aten kernels
(half-precision splits). ``monitor/reference.py`` is the plain twin every sum is tested against.
Definitions: ``stats`` and docs/design.md.
"""

from .arena import Arena, pad_to_stack, warm
from .bases import LayerBases
from .grid import Grid
from .projection import Memo, Projection, project
from .stacked import reduce_many


def reduce_one(bases: LayerBases, points: dict, mask, base=None, consensus: bool = True):
    """Both stages for one layer alone: (state sums like ``measures.zero_state``, per-row counters (b, len(measures.ROW), T))."""
    return reduce_many([(bases, project(bases, points, mask, base, consensus))])[0]


__all__ = [
    "Arena",
    "Grid",
    "LayerBases",
    "Memo",
    "Projection",
    "pad_to_stack",
    "project",
    "reduce_many",
    "reduce_one",
    "warm",
]
