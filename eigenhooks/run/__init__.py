"""The main job: token batches from text, files or datasets, the monitored pass, and a run folder.

Owns ``run`` (``job``: what ``eigenhooks run`` calls), torchrun's process group for it
(``distributed``), the texts and their batches (``texts``), the run folder that never lies
about itself (``folder``), and what is made from a finished run: the table (``table``), the
plots (drawn by ``eigenhooks.plots``) and the HTML report (``report``). It may import every wing below it; only the
CLI imports it.
"""

from .folder import RunFolderError
from .job import RunResult, run
from .texts import DataLoadError, load_texts, make_batches, sample_text

__all__ = ["DataLoadError", "RunFolderError", "RunResult", "load_texts", "make_batches", "run", "sample_text"]
