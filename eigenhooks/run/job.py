"""The main job: spectra, a monitored pass over text, and a run folder with table, plots, report.

``eh.run(...)`` is what ``eigenhooks run`` calls. The run folder holds meta.json,
stats.jsonl (one line per forward, appended and flushed as it goes), summary.csv (and
summary.parquet), spectra.json, the plots and report.html.

A run folder never lies about itself:

- the run is built in a hidden sibling folder (``.NAME.tmp-TAG-PID``) and renamed to ``out`` at
  the end, so a killed run (even SIGKILL) never mixes with an earlier one;
- ``out`` is refused if it already holds a run, unless ``overwrite=True`` (``--overwrite``);
  the old run stays intact until the new one is renamed in;
- a finished run is never replaced by a run that did not ask to replace it: of two runs into
  one ``out`` the first to finish gets it, the other ends in ``out-2`` and fails saying where
  both are (``folder.RunFolder``); the default ``out`` is ``runs/MODEL-YYYYmmdd-HHMMSS-XXXX``
  (4 random hex digits), so runs started in the same second do not meet;
- meta.json is written first, with ``status: running`` and the current ``stage``, and ends
  as ``complete``, ``interrupted`` (Ctrl-C at any stage: what was measured is kept) or
  ``failed`` (with the error). While the final files are written a second Ctrl-C waits.

Under ``torchrun --nproc-per-node N`` every rank reads the same token stream, keeps the
batches ``i % N == rank``, and the monitors are summed with ``Monitor.all_reduce``; rank
0 writes the folder, with ``world_size``, ``tokens_per_rank`` and ``forwards_per_rank`` in
meta.json (``forwards`` counts every rank's). Each rank's monitor writes its per-forward lines
(rank 0 into stats.jsonl, the others into a temporary file), and at the end rank 0 gathers
them (``distributed.gather_jsonl``) into the one stats.jsonl, rank by rank, each line with
its ``rank``. A run stopped before that (Ctrl-C, an error) records rank 0's part only, and
meta.json says so (``ranks_recorded``).
"""

from __future__ import annotations

import errno
import os
import platform
import secrets
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..progress import bar
from . import direction_report
from . import distributed as D
from .checks import check_device, check_finite, check_nulls, check_sizes, installed_version, interrupted
from .folder import RunFolder, RunFolderError, RunFolderWarning, deferred_sigint, import_whole
from .texts import DataLoadError, TokenBatches, iter_texts, load_texts, make_batches, sample_text

TARGETS = (("ov", "modulus"), ("ov", "residual"))
HEAD_TARGETS = (("ov_head", "modulus"),)  # --heads: each query head's principal subspace (docs/concepts.md)
__all__ = ["DataLoadError", "RunFolderError", "RunResult", "load_texts", "make_batches", "run", "sample_text"]


@dataclass
class RunResult:
    """What ``run`` did: the folder, the summary table (None if nothing was measured), the final status."""

    out: Path
    summary: object  # pandas DataFrame, or None
    status: str  # complete | interrupted
    stage: str = ""  # the stage an interrupted run stopped in
    tokens_per_s: float | None = None
    forwards: int = 0  # forwards measured (over all ranks' monitors, on rank 0 after the reduction)
    kept: bool = True  # False: nothing was measured and ``out`` was left as it was
    rank: int = 0
    report_error: str | None = None  # why report.html was not written (e.g. a full disk), if it was not

    @property
    def interrupted(self) -> bool:
        return self.status == "interrupted"

    def __repr__(self) -> str:  # a line; the table itself is ``summary`` (``to_frame()``)
        rows = "no summary" if self.summary is None else f"summary {len(self.summary)} rows"
        rate = "" if self.tokens_per_s is None else f", {self.tokens_per_s:,.0f} tokens/s"
        stage = f" in {self.stage}" if self.interrupted and self.stage else ""
        return f"RunResult({self.status}{stage}, {self.forwards} forwards{rate}, {rows}, out={str(self.out)!r})"

    def to_frame(self):
        """The summary table (a DataFrame; None when nothing was measured)."""
        return self.summary


class _Study:
    """The state of one run as it goes: what exists so far is what an interrupt can save."""

    def __init__(self, folder: RunFolder | None):
        self.folder = folder
        self.model = self.tok = self.mon = self.summary = None
        self.specs: dict | None = None
        self.first: torch.Tensor | None = None
        self.tokens = 0  # tokens this rank fed to the model
        self.tokens_per_rank: list[int] | None = None
        self.forwards_per_rank: list[int] | None = None  # set once the ranks are gathered
        self.seconds = 0.0
        self.streamed = False  # a --dataset: its length is not known before the forwards

    def stage(self, name: str) -> None:
        if self.folder is not None:
            self.folder.stage(name)
        _test_pause(name)


def _test_pause(stage: str) -> None:
    """Test hook: EIGENHOOKS_TEST_PAUSE=STAGE[,STAGE] sleeps there (EIGENHOOKS_TEST_PAUSE_S s), for signal
    and race tests; with EIGENHOOKS_TEST_RESUME=FILE it goes on as soon as FILE exists."""
    if stage in os.environ.get("EIGENHOOKS_TEST_PAUSE", "").split(","):
        print(f"eigenhooks-test: paused at {stage}", file=sys.stderr, flush=True)
        resume = os.environ.get("EIGENHOOKS_TEST_RESUME")
        end = time.monotonic() + float(os.environ.get("EIGENHOOKS_TEST_PAUSE_S", "60"))
        while time.monotonic() < end and not (resume and os.path.exists(resume)):
            time.sleep(min(0.05, max(end - time.monotonic(), 0)))


def run(
    model: str = "gpt2-tiny",
    *,
    text=None,
    file=None,
    dataset=None,
    max_tokens: int = 4096,
    batch_size: int = 8,
    device: str | None = None,
    dtype: str | None = None,
    out: str | Path | None = None,
    overwrite: bool = False,
    backend: str = "hf",
    seed: int = 0,
    nulls: dict | None = None,
    heads: bool = False,
    progress: bool | None = None,
    command: list[str] | None = None,
    dist_timeout: float = 300.0,
) -> RunResult:
    """Run the whole study on a model and write a run folder.

    Args:
        model: a zoo name, a ``.gguf`` file, a local folder or a hub id.
        text, file, dataset: at most one source of text (default: the bundled sample);
            ``dataset`` is a local .txt/.jsonl/.csv/.parquet file (streamed offline by HF
            datasets) or a hub ``NAME[:split]``.
        max_tokens: tokens to monitor (>= 1), over all ranks.
        batch_size: sequences per forward (>= 1).
        device, dtype: where and in which precision to run the model.
        out: the run folder (default ``runs/MODEL-TIME``); refused if it holds a run.
        overwrite: replace a run already in ``out`` (only once the new one is written).
        backend: 'hf', or 'lens' for a TransformerLens bridge.
        nulls: the monitor's null settings, any of ``null_draws``, ``null_seed``,
            ``null_stride``, ``fnull_draws``, ``eig_top`` (see ``eh.monitor``; default: its
            defaults). Recorded in meta.json. More Haar draws lower p_null's floor 2/(K+1):
            with 30 layers, one layer alone can pass BH at 0.05 from K >= 1200.
        heads: also measure each query head's principal subspace (``HEAD_TARGETS``): one summary row
            per (layer, head), with a ``head`` column, a BH family of their own.
        progress: a bar of the monitored forwards on stderr (``eigenhooks.progress``: None draws it
            where a person looks, a terminal or a notebook; True, False force it).
        dist_timeout: under torchrun, seconds to wait for the other ranks, at the start and at
            every collective (``--dist-timeout``); a process given WORLD_SIZE > 1 with no peers
            says what it waits for after a second and fails in one line after this long.

    Returns:
        RunResult (status 'complete' or 'interrupted'; a failure raises).

    Raises:
        ValueError: a size below 1, a dist_timeout that is not a positive number, an unknown dtype.
        RuntimeError: under torchrun, the other ranks did not come within ``dist_timeout``.
        RunFolderError: ``out`` already holds a run (and ``overwrite`` is False).
        DataLoadError: text or dataset problems. Any other error of the run, after the
            folder is marked ``failed``.
    """
    check_sizes(max_tokens, batch_size, dist_timeout)
    check_device(device)
    nulls = check_nulls(nulls)
    torch_dtype = _dtype(dtype)
    texts = iter_texts(text, file, dataset)  # checks the source now, reads it lazily
    ctx = D.setup(device, timeout=dist_timeout)
    meta = _base_meta(model, backend, seed, max_tokens, batch_size, command, ctx)
    meta["nulls"] = nulls
    folder = None
    if ctx.rank == 0:
        folder = RunFolder(
            _default_out(model) if out is None else Path(out), overwrite=overwrite, named=out is not None
        )
        folder.open(meta)
    st = _Study(folder)
    st.streamed = dataset is not None
    status, error = "complete", None
    try:
        targets = TARGETS + (HEAD_TARGETS if heads else ())
        _study(st, model, texts, torch_dtype, ctx, backend, max_tokens, batch_size, seed, nulls, progress, targets)
    except KeyboardInterrupt:
        status = "interrupted"
    except BaseException as e:
        # Ctrl-C that a library wrapped in its own error (transformers' lazy imports) is still Ctrl-C
        status, error = ("interrupted", None) if interrupted(e) else ("failed", e)
    if folder is None:  # ranks > 0 write nothing
        if error is not None:
            raise error
        return RunResult(Path(out or "."), st.summary, status, rank=ctx.rank)
    with deferred_sigint():
        stage = folder.meta.get("stage", "")
        try:
            _finish(st, folder, status, error, ctx)
        except OSError as e:  # a full disk: no half-written hidden folder stays, and the error says where
            raise folder.abandon(e) from (error or e)
    if isinstance(error, OSError) and error.errno in _NO_SPACE and not error.filename:
        raise RunFolderError(
            f"--out {folder.out}: {error.strerror} while the run wrote there (status failed)"
        ) from error
    if error is not None:
        raise error
    m = folder.meta
    if folder.report_error:
        warnings.warn(
            f"{folder.report_error}; the run's files are whole: free space, then `eigenhooks report {folder.out}`",
            RunFolderWarning,
            stacklevel=2,
        )
    return RunResult(
        folder.out,
        st.summary,
        status,
        stage,
        m.get("tokens_per_s"),
        m.get("forwards", 0),
        folder.kept,
        report_error=folder.report_error,
    )


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a write that failed for room: the run folder is named

# The compiled modules that finishing a run folder uses (the summary, its CSV and parquet, the report).
FINISH_IMPORTS = ("pandas", "pandas.io.parquet", "pyarrow.parquet", "scipy.stats")


def _study(
    st: _Study, model, texts, torch_dtype, ctx, backend, max_tokens, batch_size, seed, nulls, progress, targets
) -> None:  # fmt: skip
    from ..monitor import monitor
    from ..spectra.compute import spectra_by_rank
    from ..zoo.loading import load_model

    torch.manual_seed(seed)
    st.stage("load")
    import_whole(FINISH_IMPORTS)  # a Ctrl-C from here on leaves them whole for _finish
    st.model, st.tok = load_model(model, dtype=torch_dtype, device=ctx.device, backend=backend)
    if st.tok is None:
        raise DataLoadError(f"{model} has no tokenizer saved beside it; eigenhooks run needs one")
    if st.folder is not None:
        st.folder.meta.update(_model_meta(st.model))
    st.stage("spectra")
    st.specs = spectra_by_rank(st.model, "ov", tuple(rank for _, rank in TARGETS))  # one eig per layer for both
    st.stage("forwards")
    batches = TokenBatches(st.tok, texts, max_tokens, _seq_len(st.model), batch_size)
    sink = _sink(st, ctx)
    try:
        st.mon = monitor(st.model, targets=list(targets), sink=sink, **nulls)
        t0 = time.perf_counter()
        try:
            total = None if st.streamed else batches.count()  # the text's tokens; a dataset streams: a count only
            _forwards(st, batches, ctx, backend, progress if ctx.rank == 0 else False, total)
        finally:
            st.seconds = time.perf_counter() - t0
        if ctx.rank == 0:
            batches.warn_unknown(f"the text fed to {model}")
        if ctx.world > 1:
            st.stage("reduce")
            _reduce(st, sink)
    finally:
        if st.folder is None and sink is not None:
            sink.unlink(missing_ok=True)
    show = progress if ctx.rank == 0 else False
    with bar("the run folder: summary table", 3 if st.folder is not None else 1, show) as b:
        st.stage("summary")
        st.summary = st.mon.summary()
        check_finite(st.summary, model)
        b.advance()
        if st.folder is not None:
            st.stage("plots")
            b.update(description="the run folder: plots")
            _plots(st.folder.path, st, backend)
            b.advance()
            b.update(description="the run folder: token readouts of every layer, head and group")
            direction_report.write(st.folder.path, st.model, st.tok)  # the report's "What the direction is"
            b.advance()


def _sink(st: _Study, ctx) -> Path | None:
    """Where this rank's monitor writes one line per forward: stats.jsonl in the folder on rank 0,
    a private temporary file on the other ranks (gathered into stats.jsonl by ``_reduce``)."""
    if st.folder is not None:
        return st.folder.path / "stats.jsonl"
    if ctx.world == 1:
        return None
    fd, name = tempfile.mkstemp(prefix=f"eigenhooks-stats-rank{ctx.rank}-", suffix=".jsonl")
    os.close(fd)
    return Path(name)


def _reduce(st: _Study, sink: Path | None) -> None:
    """Sum the monitors over the ranks and bring every rank's counts and per-forward lines to rank 0."""
    st.mon.all_reduce()
    st.tokens_per_rank = D.gather_ints(st.tokens)
    st.forwards_per_rank = D.gather_ints(st.mon.n_forwards)
    D.gather_jsonl(sink, sink if st.folder is not None else None)


def _forwards(
    st: _Study, batches: TokenBatches, ctx, backend: str, progress: bool | None, total: int | None = None
) -> None:
    import warnings

    from ..monitor import MeasurementWarning

    dev = next(st.model.parameters()).device
    fed, i = 0, -1
    with warnings.catch_warnings(), st.mon, torch.no_grad():  # the filters set below end with the block
        for i, ids in enumerate(_progress(batches, progress, total)):
            if st.first is None:
                st.first = ids[:1]
            if i % ctx.world != ctx.rank:
                continue  # another rank's batch
            ids = ids.to(dev)
            if backend == "lens":
                st.model(ids)
            else:
                st.model(input_ids=ids, attention_mask=torch.ones_like(ids))
            st.tokens += ids.numel()
            fed += 1
            if i == 0:
                st.stage("forwards:after-first")
        if fed == 0 and ctx.world > 1:  # the monitor would blame torch.compile for a rank that had no batch
            warnings.filterwarnings("ignore", message="no forward pass reached", category=MeasurementWarning)
    if fed == 0 and ctx.world > 1:
        warnings.warn(
            f"rank {ctx.rank} of {ctx.world} got no batch (the text made {i + 1} batch(es) of --batch-size "
            f"{batches.batch_size}) and measured nothing: give more text, a smaller --batch-size, or fewer ranks",
            MeasurementWarning,
            stacklevel=3,
        )


def _finish(st: _Study, folder: RunFolder, status: str, error, ctx) -> None:
    """Write what exists with a true status, then put the folder in place (a second Ctrl-C waits)."""
    _test_pause("finish")
    measured = st.mon is not None and st.mon.n_forwards > 0
    if status == "complete":
        folder.meta["stage"] = "done"
    if status != "complete" and measured and st.summary is None:
        try:
            st.summary = st.mon.summary()
        except Exception as e:  # the partial table is a bonus; the status must still be written
            folder.meta["summary_error"] = f"{type(e).__name__}: {e}"
    folder.meta.update(_result_meta(st, ctx, status, error))
    folder.finish(status, st.summary, st.specs, measured=measured)


def _result_meta(st: _Study, ctx, status: str, error) -> dict:
    n_tokens = int(st.summary["n_tokens"].max()) if st.summary is not None and len(st.summary) else 0
    forwards = st.mon.n_forwards if st.mon is not None else 0
    meta = {
        "forwards": sum(st.forwards_per_rank) if st.forwards_per_rank else forwards,
        "n_tokens": n_tokens,
        "seconds": round(st.seconds, 3),
        "tokens_per_s": round(n_tokens / st.seconds, 1) if st.seconds > 0 and n_tokens else None,
        "world_size": ctx.world,
        "tokens_per_rank": st.tokens_per_rank or [st.tokens],
        "forwards_per_rank": st.forwards_per_rank or [forwards],
        "interrupted": status == "interrupted",
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if ctx.world > 1 and st.forwards_per_rank is None:
        meta["ranks_recorded"] = "rank 0 only: the run stopped before the ranks were gathered"
    if error is not None:
        meta["error"] = f"{type(error).__name__}: {error}"
    return meta


def _base_meta(model, backend, seed, max_tokens, batch_size, command, ctx) -> dict:
    from ..data import __version__

    return {
        "model": model,
        "backend": backend,
        "seed": seed,
        "command": " ".join(command or sys.argv),
        "max_tokens": max_tokens,
        "batch_size": batch_size,
        "world_size": ctx.world,
        "eigenhooks": __version__,
        "torch": torch.__version__,
        "transformers": installed_version("transformers"),
        "python": platform.python_version(),
        "pid": os.getpid(),
        "host": platform.node(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _model_meta(m) -> dict:
    from ..models import get_adapter

    p = next(m.parameters())
    return {"device": str(p.device), "dtype": str(p.dtype), "adapter": get_adapter(m).describe()}


def _default_out(model: str) -> Path:
    """runs/MODEL-YYYYmmdd-HHMMSS-XXXX: the start second and 4 random hex digits, so that runs started
    in one second (by one process or several) get folders of their own; a free name is taken."""
    for _ in range(100):
        p = Path("runs") / f"{Path(model).name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
        if not p.exists():
            return p
    return p  # 100 names in use: RunFolder says so


def _seq_len(model, wanted: int = 128) -> int:
    cfg = getattr(model, "config", None) or getattr(model, "cfg", None)
    limit = (
        getattr(cfg, "n_positions", None)
        or getattr(cfg, "max_position_embeddings", None)
        or getattr(cfg, "n_ctx", None)
    )
    return min(wanted, int(limit)) if limit else wanted


def _plots(out: Path, st: _Study, backend: str) -> None:
    try:
        from ..plots.figures import _plt, alignment_by_layer, eigenvalue_planes, token_heatmap

        plt = _plt()  # Agg unless a backend was chosen (a notebook's stays as it is)
    except ImportError:
        (out / "plots-skipped.txt").write_text("matplotlib not installed: pip install 'eigenhooks[plot]'\n")
        return
    from ..monitor import monitor
    from ..monitor.summary import layer_rows

    summary, model = layer_rows(st.summary), st.model
    for rank in ("modulus", "residual"):
        if (summary["rank"] == rank).any():
            alignment_by_layer(summary, rank).savefig(out / f"alignment_{rank}.png", dpi=110)
    eigenvalue_planes(st.specs["modulus"]).savefig(out / "eigenvalues.png", dpi=110)
    first = st.first.to(next(model.parameters()).device)
    with monitor(model, targets=[("ov", "modulus")], tokens=True) as mon, torch.no_grad():
        model(first) if backend == "lens" else model(input_ids=first, attention_mask=torch.ones_like(first))
    recs = sorted((r for r in mon.token_records), key=lambda r: r["layer"])
    if recs:
        values = torch.stack([r["a_pre"][0] for r in recs]).numpy()
        labels = [st.tok.decode([i]) for i in first[0].tolist()]
        token_heatmap(values, labels).savefig(out / "heatmap.png", dpi=110)
    plt.close("all")


def _progress(batches: TokenBatches, show: bool | None, total: int | None):
    """The batches, moving the progress wing's bar (stderr, where a person looks) by the tokens fed: out of
    the text's tokens (at most --max-tokens), or a count alone when a dataset streams."""
    said = "monitored forwards: tokens of the text" if total is not None else "monitored forwards: tokens streamed"
    with bar(said, total, show) as b:
        for x in batches:
            yield x
            b.update(completed=batches.n_tokens)


def _dtype(name: str | None):
    if name is None:
        return None
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "float16": torch.float16,
        "fp16": torch.float16,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float64": torch.float64,
    }
    if name not in table:
        raise ValueError(f"--dtype must be one of {', '.join(table)}, got {name!r}")
    return table[name]
