"""Where the monitor's numbers go while the model runs: a .jsonl file, TensorBoard, W&B, MLflow, a callable.

A sink takes up to three things from the monitor (``logs.py`` decides when):

- ``forward(n, stats)``: one forward's own sums, appended as one line per forward (the .jsonl
  file only; ``undo()`` takes the line back when that forward does not count);
- ``scalars(step, values)``: the running gamma_pre / gamma_mid / gamma_post, rho and n_tokens of
  every (layer, target), tagged ``eigenhooks/rho/L07/ov-modulus`` (metric, layer, target: the
  first part groups the charts in each UI), every ``log_every`` forwards;
- ``table(step, df)``: the summary table, in each library's own form: TensorBoard text (a
  markdown table), a wandb ``Table``, an MLflow artifact ``eigenhooks/summary.csv``.

TensorBoard, wandb and MLflow are optional extras (``pip install 'eigenhooks[tensorboard]'``,
``[wandb]``, ``[mlflow]``), imported only when such a sink is asked for.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path

log = logging.getLogger(__name__)
METRICS = ("gamma_pre", "gamma_mid", "gamma_post", "rho", "n_tokens")
SUMMARY_TAG = "eigenhooks/summary"
STEP_TAG = "eigenhooks/step"  # wandb: the x-axis of every eigenhooks chart (define_metric)
# the columns of the TensorBoard text table (the full table goes to wandb and MLflow)
TEXT_COLUMNS = (
    "layer",
    "target",
    "kind",
    "abs_lambda_1",
    "n_tokens",
    "gamma_pre",
    "gamma_mid",
    "gamma_post",
    "rho",
    "rho_ci_lo",
    "rho_ci_hi",
    "null_rho_lo",
    "null_rho_hi",
    "rho_percentile",
    "p_null",
    "q_null",
    "eig_rank",
    "verdict",
)
_MLFLOW_BATCH = 1000  # MLflow's limit of metrics per log_batch call


class SinkError(RuntimeError):
    """A sink could not be written. Raised in a forward, that forward was not counted (docs/api.md, "Sinks",
    "Failures")."""


class Sink:
    """The interface: every method does nothing unless a sink overrides it."""

    name = "sink"
    per_forward = False  # takes forward(); the others take scalars() and table()

    def forward(self, n: int, stats: list[dict]) -> None:
        """Append forward n's own sums."""

    def undo(self) -> None:
        """Take back what the last ``forward`` wrote (its forward did not count)."""

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """Log the running values at ``step``."""

    def table(self, step: int, df) -> None:
        """Log the summary table (a pandas DataFrame) at ``step``."""

    def close(self) -> None:
        """Flush; close what the sink opened itself."""


class JsonlSink(Sink):
    """One line per forward: ``{"forward": n, "stats": [{"layer", "target", <TGT_FIELDS>...}]}``."""

    per_forward = True

    def __init__(self, path) -> None:
        self.path = Path(path)
        self.name = str(self.path)
        self._end: int | None = None  # the file's size before the last line

    def forward(self, n: int, stats: list[dict]) -> None:
        line = json.dumps({"forward": n, "stats": stats}) + "\n"
        self._end = None
        with open(self.path, "a") as fh:
            self._end = fh.tell()  # append mode starts at the end
            try:
                fh.write(line)
                fh.flush()
            except BaseException:
                self.undo()  # no half line
                raise

    def undo(self) -> None:
        if self._end is None:
            return
        try:
            os.truncate(self.path, self._end)
        except OSError as e:  # the write that failed may have left nothing to take back
            log.warning("could not take back the last line of %s: %s", self.path, e)
        self._end = None


class TensorBoardSink(Sink):
    """``add_scalar`` per tag; the summary as a markdown table (``add_text``)."""

    def __init__(self, writer, owned: bool) -> None:
        self.writer, self.owned = writer, owned
        self.name = f"TensorBoard ({getattr(writer, 'log_dir', '?')})"

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if _plain_summary_writer(self.writer):
            # One event holding every value: 0.15 ms for 120 tags where add_scalar per tag takes 10 ms
            # (each builds its own Summary and event). EventAccumulator reads them as separate scalars.
            from tensorboard.compat.proto.summary_pb2 import Summary

            summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(v)) for tag, v in values.items()])
            self.writer._get_file_writer().add_summary(summary, step)
            return
        for tag, v in values.items():  # tensorboardX, or a writer whose add_scalar is its own
            self.writer.add_scalar(tag, v, global_step=step)

    def table(self, step: int, df) -> None:
        self.writer.add_text(SUMMARY_TAG, markdown_table(df), global_step=step)

    def close(self) -> None:
        self.writer.flush()
        if self.owned:
            self.writer.close()  # a later add_* opens a new event file in the same folder


def _plain_summary_writer(writer) -> bool:
    """torch's own SummaryWriter, its add_scalar not overridden: its file writer takes a whole Summary."""
    import sys

    tb = sys.modules.get("torch.utils.tensorboard")
    cls = getattr(tb, "SummaryWriter", None)
    return cls is not None and isinstance(writer, cls) and type(writer).add_scalar is cls.add_scalar


class WandbSink(Sink):
    """``run.log`` with ``eigenhooks/step`` as the x-axis of the eigenhooks charts.

    The step goes in as a value (``define_metric``), never as ``run.log(step=...)``: wandb's own
    step must only increase, and the user's logging owns it.
    """

    name = "wandb"

    def __init__(self, run) -> None:
        if getattr(run, "_is_finished", False):  # wandb would refuse each call with its UsageError
            raise ValueError(
                f"the wandb run {getattr(run, 'id', '?')} given as sink is finished: log to an active run "
                "(wandb.init(), or sink='wandb' for the active one)"
            )
        self.run = run
        run.define_metric(STEP_TAG)
        run.define_metric("eigenhooks/*", step_metric=STEP_TAG)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log({**values, STEP_TAG: step})

    def table(self, step: int, df) -> None:
        wandb = _require("wandb", "wandb", "a wandb sink")
        self.run.log({SUMMARY_TAG: wandb.Table(dataframe=_plain(df)), STEP_TAG: step})


class MlflowSink(Sink):
    """``MlflowClient.log_batch`` to one run (the one active when the monitor was made)."""

    name = "MLflow"

    def __init__(self, run_id: str) -> None:
        mlflow = _require("mlflow", "mlflow", "sink='mlflow'")
        self.client, self.run_id = mlflow.MlflowClient(), run_id
        self._Metric = mlflow.entities.Metric

    def scalars(self, step: int, values: dict[str, float]) -> None:
        ts = int(time.time() * 1000)
        metrics = [self._Metric(k, float(v), ts, int(step)) for k, v in values.items()]
        for at in range(0, len(metrics), _MLFLOW_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[at : at + _MLFLOW_BATCH])

    def table(self, step: int, df) -> None:
        self.client.log_text(self.run_id, df.to_csv(index=False), f"{SUMMARY_TAG}.csv")


class CallableSink(Sink):
    """Any ``fn(step, scalars)``; it gets the running values (the summary stays ``mon.summary()``)."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.name = getattr(fn, "__qualname__", type(fn).__name__)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.fn(step, dict(values))


def make_sinks(sink) -> list[Sink]:
    """The sinks for ``eh.monitor(sink=...)``: one spec, or a list or tuple of them.

    A spec is a path (a .jsonl file), ``"tensorboard:DIR"`` or a ``SummaryWriter``, ``"wandb"``
    (the active run) or a wandb run, ``"mlflow"`` (the active run), or a callable ``(step, scalars)``.

    Raises:
        ImportError: the library a sink needs is not installed (the message names the extra).
        ValueError: no active wandb or MLflow run, a finished wandb run, a TensorBoard folder that
            cannot be made, or a spec of no known kind.
    """
    if sink is None:
        return []
    specs = list(sink) if isinstance(sink, list | tuple) else [sink]
    return [_make_sink(s) for s in specs]


def _make_sink(spec) -> Sink:
    if isinstance(spec, str):
        head, _, rest = spec.partition(":")
        if head == "tensorboard":
            if not rest:
                raise ValueError("sink='tensorboard:DIR' needs a folder after the colon, e.g. 'tensorboard:runs/exp1'")
            tb = _require("torch.utils.tensorboard", "tensorboard", f"sink={spec!r}")
            try:
                writer = tb.SummaryWriter(log_dir=rest)
            except OSError as e:  # e.g. a file where a folder of the path should be
                raise ValueError(
                    f"sink={spec!r}: cannot make the folder {rest} ({e.strerror or e}): give a folder that is "
                    "or can be made"
                ) from e
            return TensorBoardSink(writer, owned=True)
        if spec == "wandb":
            wandb = _require("wandb", "wandb", "sink='wandb'")
            if wandb.run is None:
                raise ValueError(
                    "sink='wandb' logs to the active wandb run, and there is none: call wandb.init() first"
                )
            return WandbSink(wandb.run)
        if spec == "mlflow":
            mlflow = _require("mlflow", "mlflow", "sink='mlflow'")
            run = mlflow.active_run()
            if run is None:
                raise ValueError(
                    "sink='mlflow' logs to the active MLflow run, and there is none: call mlflow.start_run() first"
                )
            return MlflowSink(run.info.run_id)
    if isinstance(spec, str | os.PathLike):
        return JsonlSink(spec)
    module = type(spec).__module__ or ""
    if hasattr(spec, "add_scalar") and hasattr(spec, "add_text"):  # torch's SummaryWriter, tensorboardX's
        return TensorBoardSink(spec, owned=False)
    if module.startswith("wandb") and hasattr(spec, "log") and hasattr(spec, "define_metric"):
        return WandbSink(spec)
    if callable(spec):
        return CallableSink(spec)
    raise ValueError(
        f"unknown sink {spec!r} ({type(spec).__name__}): give a .jsonl path, 'tensorboard:DIR' or a SummaryWriter, "
        "'wandb' or a wandb run, 'mlflow', or a callable (step, scalars)"
    )


def _require(module: str, extra: str, what: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{what} needs {extra}, which is not installed: pip install 'eigenhooks[{extra}]'") from e


# ---- the values ----


def tag(metric: str, layer: int, target: str | None, width: int = 2) -> str:
    """``eigenhooks/rho/L07/ov-modulus``: metric, then layer, then target ('/' and characters
    the trackers refuse become '-'); a per-layer value (a researcher's measure) has no target part."""
    at = f"eigenhooks/{metric}/L{layer:0{width}d}"
    return at if target is None else f"{at}/{_tag_part(target)}"


def _tag_part(target: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "-", target)


def check_tags(target_names: Sequence[str]) -> None:
    """Refuse target names that two sinks' tags cannot tell apart (``tag`` maps both to one).

    Raises:
        ValueError: two names give one tag (e.g. 'ov-modulus' and the built-in 'ov/modulus'),
            naming both and the tag.

    Example:
        >>> check_tags(["ov/modulus", "mine"])
    """
    seen: dict[str, str] = {}
    for name in target_names:
        part = _tag_part(name)
        if part in seen and seen[part] != name:
            raise ValueError(
                f"targets {seen[part]!r} and {name!r} share the sink tag '.../{part}' (characters other than "
                "letters, digits, '_', '.', '-' become '-'): rename one of them"
            )
        seen[part] = name


def markdown_table(df, columns: Sequence[str] = TEXT_COLUMNS) -> str:
    """The summary as a markdown table (TensorBoard's text plugin renders it)."""
    cols = [c for c in columns if c in df.columns]
    cell = lambda v: f"{v:.6g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df[cols].itertuples(index=False)]
    return "\n".join(lines)


def _plain(df):
    """The table with plain object columns for strings (wandb's Table reads numpy, not pandas' string dtype)."""
    out = df.copy()
    for c in out.columns:
        if out[c].dtype.kind not in "biufc":
            out[c] = out[c].astype(object)
    return out
