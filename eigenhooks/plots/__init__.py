"""Figures of eigenhooks' results: rho by layer against its null band with gamma, eigenvalue planes,
token heat maps, trajectories. Each function takes a summary DataFrame, spectra or arrays and returns a
matplotlib Figure; none calls ``show``. matplotlib is optional (``pip install 'eigenhooks[plot]'``) and
imported lazily. The monitor (``Monitor.plot``) and the run folder both draw through it, so it sits
between them on the ladder: it may import the wings below it (it needs none today), never the monitor
or run.
"""

from .figures import alignment_by_layer, by_layer, eigenvalue_planes, readable, token_heatmap, trajectories

__all__ = ["alignment_by_layer", "by_layer", "eigenvalue_planes", "readable", "token_heatmap", "trajectories"]
