"""The main job: spectra, a monitored pass over text, and a run folder with table, plots, report.

``eh.run(...)`` is what ``eigenhooks run`` calls. The run folder holds summary.csv (and
summary.parquet where pyarrow is installed), spectra.json, meta.json, stats.jsonl (one
line per forward, appended and flushed as it goes), the plots and report.html. An
interrupted run (Ctrl-C) still writes everything measured so far and says so in meta.json.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

TARGETS = (("ov", "modulus"), ("ov", "residual"))


class DataLoadError(RuntimeError):
    """Text or a dataset could not be loaded; the message says why."""


@dataclass
class RunResult:
    out: Path
    summary: object  # pandas DataFrame
    interrupted: bool


def sample_text() -> str:
    """The text bundled with the package (passages of Python's documentation)."""
    return resources.files("eigenhooks.data").joinpath("sample.txt").read_text()


def load_texts(text: str | None = None, file: str | None = None, dataset: str | None = None) -> list[str]:
    """Texts from exactly one of: a string, a file, an HF dataset 'name[:split]'; default the sample."""
    given = [x is not None for x in (text, file, dataset)]
    if sum(given) > 1:
        raise DataLoadError("give at most one of --text, --file and --dataset")
    if text is not None:
        return [text]
    if file is not None:
        p = Path(file)
        if not p.exists():
            raise DataLoadError(f"no such file: {file}")
        return [t for t in p.read_text().split("\n\n") if t.strip()]
    if dataset is not None:
        return _dataset_texts(dataset)
    return [t for t in sample_text().split("\n\n") if t.strip()]


def _dataset_texts(spec: str) -> list[str]:
    try:
        import datasets
    except ImportError as e:
        raise DataLoadError("--dataset needs the 'datasets' package: pip install datasets") from e
    name, _, split = spec.partition(":")
    try:
        ds = datasets.load_dataset(name, split=split or "train")
    except Exception as e:  # offline, unknown name, bad split: one clear line
        raise DataLoadError(
            f"could not load dataset {spec!r} ({type(e).__name__}); offline? use --file with a local text file instead"
        ) from e
    col = "text" if "text" in ds.column_names else ds.column_names[0]
    return [t for t in ds[col] if isinstance(t, str) and t.strip()]


def make_batches(tokenizer, texts: list[str], max_tokens: int, seq_len: int, batch_size: int) -> list[torch.Tensor]:
    """Tokenize, join, and cut into (batch, seq_len) blocks of real tokens (no padding)."""
    ids: list[int] = []
    for t in texts:
        ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
        if len(ids) >= max_tokens:
            break
    ids = ids[:max_tokens]
    if not ids:
        raise DataLoadError("the text is empty after tokenization")
    seqs = [ids[i : i + seq_len] for i in range(0, len(ids), seq_len)]
    full = [s for s in seqs if len(s) == seq_len]
    batches = [torch.tensor(full[i : i + batch_size]) for i in range(0, len(full), batch_size)]
    if len(seqs[-1]) < seq_len:
        batches.append(torch.tensor([seqs[-1]]))  # the remainder, as its own batch
    return batches


def _seq_len(model, tokenizer, wanted: int = 128) -> int:
    cfg = getattr(model, "config", None) or getattr(model, "cfg", None)
    limit = (
        getattr(cfg, "n_positions", None)
        or getattr(cfg, "max_position_embeddings", None)
        or getattr(cfg, "n_ctx", None)
    )
    return min(wanted, int(limit)) if limit else wanted


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
    backend: str = "hf",
    seed: int = 0,
    progress: bool = True,
    command: list[str] | None = None,
) -> RunResult:
    """Run the whole study on a model and write a run folder. Returns the folder and summary."""
    import eigenhooks as eh

    from .models.loading import load_model

    torch.manual_seed(seed)
    torch_dtype = _dtype(dtype)
    texts = load_texts(text, file, dataset)
    m, tok = load_model(model, dtype=torch_dtype, device=device, backend=backend)
    if tok is None:
        raise DataLoadError(f"{model} has no tokenizer saved beside it; eigenhooks run needs one")
    out = Path(out) if out is not None else Path("runs") / f"{Path(model).name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    specs = {rank: eh.spectra(m, variant=v, rank=rank) for v, rank in TARGETS}
    batches = make_batches(tok, texts, max_tokens, _seq_len(m, tok), batch_size)
    dev = next(m.parameters()).device
    meta = {
        "model": model,
        "backend": backend,
        "device": str(dev),
        "dtype": str(next(m.parameters()).dtype),
        "seed": seed,
        "command": " ".join(command or sys.argv),
        "max_tokens": max_tokens,
        "batch_size": batch_size,
        "eigenhooks": eh.__version__,
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "adapter": eh.get_adapter(m).describe(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    sink = out / "stats.jsonl"
    sink.unlink(missing_ok=True)
    interrupted = False
    t0 = time.time()
    mon = eh.monitor(m, targets=TARGETS, sink=sink)
    with mon, torch.no_grad():
        try:
            for ids in _progress(batches, progress):
                ids = ids.to(dev)
                if backend == "lens":
                    m(ids)
                else:
                    m(input_ids=ids, attention_mask=torch.ones_like(ids))
        except KeyboardInterrupt:
            interrupted = True
    summary = mon.summary()
    meta.update(
        interrupted=interrupted,
        forwards=mon.n_forwards,
        seconds=round(time.time() - t0, 2),
        n_tokens=int(summary["n_tokens"].iloc[0]) if len(summary) else 0,
    )
    _write(out, summary, specs, meta)
    _plots(out, m, tok, summary, specs["modulus"], batches[0][:1].to(dev), backend)
    from .report import build_report

    build_report(out)
    return RunResult(out, summary, interrupted)


def _write(out: Path, summary, specs, meta) -> None:
    summary.to_csv(out / "summary.csv", index=False)
    try:
        summary.to_parquet(out / "summary.parquet")
    except ImportError:
        meta["parquet"] = "skipped: pyarrow not installed"
    spec_rows = []
    for rank, ss in specs.items():
        for s in ss:
            spec_rows.append(
                {
                    "layer": s.layer,
                    "variant": s.variant,
                    "rank": rank,
                    "kind": s.kind,
                    "k": s.k,
                    "gap_ratio": s.gap_ratio,
                    "lambda_1": [s.lambda_1.real, s.lambda_1.imag],
                    "eigenvalues": [[z.real, z.imag] for z in s.eigenvalues.tolist()],
                }
            )
    (out / "spectra.json").write_text(json.dumps(spec_rows))
    (out / "meta.json").write_text(json.dumps(meta, indent=2, default=str))


def _plots(out: Path, model, tok, summary, specs, first, backend) -> None:
    try:
        from . import plots
    except ImportError:
        return
    import eigenhooks as eh

    try:
        import matplotlib.pyplot as plt
    except ImportError:
        (out / "plots-skipped.txt").write_text("matplotlib not installed: pip install 'eigenhooks[plot]'\n")
        return
    for rank in ("modulus", "residual"):
        if (summary["rank"] == rank).any():
            plots.alignment_by_layer(summary, rank).savefig(out / f"alignment_{rank}.png", dpi=110)
    plots.eigenvalue_planes(specs).savefig(out / "eigenvalues.png", dpi=110)
    with eh.monitor(model, targets=[("ov", "modulus")], tokens=True) as mon, torch.no_grad():
        model(first) if backend == "lens" else model(input_ids=first, attention_mask=torch.ones_like(first))
    recs = sorted((r for r in mon.token_records), key=lambda r: r["layer"])
    if recs:
        values = torch.stack([r["a_pre"][0] for r in recs]).numpy()
        labels = [tok.decode([i]) for i in first[0].tolist()]
        plots.token_heatmap(values, labels).savefig(out / "heatmap.png", dpi=110)
    plt.close("all")


def _progress(items, show: bool):
    if not show:
        yield from items
        return
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("monitored forward passes", total=len(items))
        for x in items:
            yield x
            bar.advance(task)


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


def _version(pkg: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return "not installed"
