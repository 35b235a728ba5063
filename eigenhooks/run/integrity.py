"""Does a run folder hold what its meta.json says? The checks behind ``eigenhooks report``.

When a run writes its tables, meta.json gets a ``tables`` record (``table_stamp``): the summary's
row count, its layers and targets, and the size and SHA-256 of summary.csv and summary.parquet.
``damage(run_dir, meta, df)`` compares the folder with that record and with itself: a csv cut at a
row boundary, a missing meta.json, repeated or extra rows, a meta.json from another run and a
corrupt parquet each give one phrase saying what is wrong, and the report is marked damaged.
Folders written before the record existed are checked for what they can show: a full grid of
layers x targets, no repeated row, the model's layer count from meta.json's adapter.

Every other file the run wrote (stats.jsonl, spectra.json, the plots) is recorded too, in meta.json's
``files`` (``files_stamp``: size and SHA-256 of each), and meta.json is checked against itself and the
folder (``_meta_facts``): a status that is no status, a forward count that is not stats.jsonl's line
count, a token count that is not the table's, or a file the run wrote that is missing are damage.

meta.json carries a ``format`` (``META_FORMAT``, 2 since the records exist). A finished run of format 2
without its ``tables`` or ``files`` record (removed, or set to null) is damage: nothing would vouch for
the tables. A folder with no ``format`` was written before the records and is checked as above. A field
of the wrong type (``"forwards": "x"``, a count that is true) is damage in any format (``_meta_types``).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from pathlib import Path

# meta.json's ``format``: 2 since every finished run records its tables and files (none: written before)
META_FORMAT = 2
TABLES = ("summary.csv", "summary.parquet")
STATUSES = ("running", "complete", "interrupted", "failed")  # the only words meta.json's status may hold
UNRECORDED = {"meta.json", "report.html", *TABLES}  # rewritten later, or recorded in ``tables``


def _file_stamp(p: Path) -> dict:
    return {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}


def table_stamp(folder: Path, summary) -> dict:
    """What meta.json records about the tables just written to ``folder`` (for ``damage``)."""
    stamp = {
        "rows": int(len(summary)),
        "layers": int(summary["layer"].nunique()),
        "targets": sorted(str(t) for t in summary["target"].unique()),
    }
    for name in TABLES:
        if (folder / name).is_file():
            stamp[name] = _file_stamp(folder / name)
    return stamp


def files_stamp(folder: Path) -> dict:
    """Size and SHA-256 of every file the run wrote into ``folder`` so far (meta.json's ``files``).

    meta.json and report.html (rewritten later, e.g. by ``eigenhooks report``), the tables (in
    ``tables``) and hidden temporary files are left out.
    """
    return {
        p.name: _file_stamp(p)
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name not in UNRECORDED and not p.name.startswith(".")
    }


def _shown(v) -> str:
    """A value as meta.json holds it, cut to 40 characters."""
    text = json.dumps(v, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_missing(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def cut_rows(df) -> list[int]:
    """Indices of rows a cut line left without a layer, a verdict or the last column (every whole row has them:
    ``verdict_haar`` is the table's last column, a text every row fills)."""
    cols = [c for c in ("layer", "target", "verdict", "verdict_haar") if c in df.columns]
    return [i for i, r in enumerate(df[cols].to_dict("records")) if any(_is_missing(r[c]) for c in cols)]


def damage(run_dir: Path, meta: dict | None, df) -> list[str]:
    """What is wrong with a run folder's tables, one phrase each; empty when nothing is.

    Args:
        run_dir: the run folder.
        meta: its meta.json, or None if it is missing.
        df: summary.csv as read by pandas.
    """
    out = []
    if meta is None:
        out.append("meta.json is missing: the model, the status and what the tables should hold are unknown")
    cut = cut_rows(df)
    if cut:
        out.append(f"summary.csv has {len(cut)} row(s) cut short (line {cut[0] + 2}): the file ends mid-row")
    whole = df.drop(index=df.index[cut])
    out += _grid(whole)
    tables = (meta or {}).get("tables")
    if isinstance(tables, dict):
        out += _against_record(run_dir, whole, tables)
    elif meta is not None:
        n = (meta.get("adapter") or {}).get("n_layers")
        if isinstance(n, int) and whole["layer"].nunique() != n:
            out.append(f"summary.csv holds {whole['layer'].nunique()} layers, the model has {n} (meta.json)")
    out += _parquet(run_dir, df)
    if meta is not None:
        out += _meta_types(meta) + _meta_records(meta) + _meta_facts(run_dir, meta, whole)
    return out


_INT, _NUM, _STR = (int,), (int, float), (str,)
FIELD_TYPES = {  # the type of each field meta.json may hold, when it is there
    **dict.fromkeys(("format", "seed", "batch_size", "world_size", "pid", "forwards", "n_tokens"), _INT),
    **dict.fromkeys(("status", "stage", "out", "run_id", "model", "backend", "command", "started"), _STR),
    **dict.fromkeys(("finished", "error", "eigenhooks", "torch", "transformers", "device", "dtype"), _STR),
    "seconds": _NUM,
    "interrupted": (bool,),
    **dict.fromkeys(("adapter", "nulls"), (dict,)),
    **dict.fromkeys(("tokens_per_rank", "forwards_per_rank"), (list,)),
}
NULLABLE = {"max_tokens": _INT, "tokens_per_s": _NUM}  # a run writes null there too
RECORDS = ("tables", "files")  # what the folder holds: ``_meta_records``
_WANT = {_INT: "an integer", _NUM: "a number", _STR: "a string", (bool,): "true or false", (dict,): "an object"}


def _typed(v, types: tuple) -> bool:
    if isinstance(v, bool) and bool not in types:
        return False  # JSON's true is no count
    if not isinstance(v, types) or (isinstance(v, float) and not math.isfinite(v)):
        return False
    return not isinstance(v, list) or all(_typed(x, _INT) for x in v)


def _meta_types(meta: dict) -> list[str]:
    """Fields of meta.json whose value is of the wrong type: ``"forwards": "x"`` is damage, not a count."""
    out = []
    for name, types in {**FIELD_TYPES, **NULLABLE}.items():
        v = meta.get(name)
        if name not in meta or (v is None and name in NULLABLE) or _typed(v, types):
            continue
        want = _WANT.get(types, "a list of integers")
        out.append(f"meta.json's {name} is {_shown(v)}, not {want}")
    return out


def _meta_records(meta: dict) -> list[str]:
    """meta.json's ``tables`` and ``files``: a record that is there must be an object, and a finished run of
    format 2 or later has both (without them nothing in the folder is vouched for). A folder written before
    the records existed has no ``format`` and is not asked for them."""
    fmt = meta.get("format")
    required = _typed(fmt, _INT) and fmt >= 2 and meta.get("status") in STATUSES[1:]
    out = []
    for name in RECORDS:
        if name in meta and not isinstance(meta[name], dict):
            out.append(f"meta.json's {name} record is {_shown(meta[name])}, not an object")
        elif name not in meta and required:
            out.append(f"meta.json has no {name} record (a finished run of format {fmt} writes one)")
    return out


def _meta_facts(run_dir: Path, meta: dict, df) -> list[str]:
    """meta.json against the words a status may be, the files it records, stats.jsonl and the table."""
    out = []
    status = meta.get("status", "complete")  # folders from before statuses existed have none
    if status not in STATUSES:
        out.append(f"meta.json's status {status!r} is none of {', '.join(STATUSES)}")
    files = meta.get("files")
    if isinstance(files, dict):
        for name, rec in sorted(files.items()):
            p = run_dir / name
            if not p.is_file():
                out.append(f"{name} is missing (meta.json records it)")
            elif _file_stamp(p) != rec:
                out.append(
                    f"{name} is not the file meta.json recorded (SHA-256 differs: edited, damaged, or cut short)"
                )
    forwards, stats = meta.get("forwards"), run_dir / "stats.jsonl"
    if isinstance(forwards, int) and not isinstance(forwards, bool) and forwards > 0:
        if not stats.is_file():
            if not isinstance(files, dict):  # else already said above
                out.append(f"stats.jsonl is missing (meta.json says {forwards} forwards)")
        else:
            lines = sum(1 for line in stats.read_bytes().splitlines() if line.strip())
            if lines != forwards:
                out.append(f"stats.jsonl holds {lines} forward(s), meta.json says {forwards}")
    n_tokens = meta.get("n_tokens")
    if isinstance(n_tokens, int) and "n_tokens" in df.columns and len(df):
        have = df["n_tokens"].max()
        if not _is_missing(have) and int(have) != n_tokens:
            out.append(f"summary.csv counts {int(have)} tokens, meta.json says {n_tokens}")
    return out


def _grid(df) -> list[str]:
    """Every layer has every target, once; layers run from 0 without a gap."""
    out = []
    keys = [(int(r["layer"]), str(r["target"])) for r in df[["layer", "target"]].to_dict("records")]
    repeated = sorted(k for k, c in Counter(keys).items() if c > 1)
    if repeated:
        out.append(
            f"summary.csv repeats {len(repeated)} (layer, target) row(s), e.g. layer {repeated[0][0]} {repeated[0][1]}"
        )
    layers, targets = sorted({k[0] for k in keys}), sorted({k[1] for k in keys})
    missing = [(la, t) for la in layers for t in targets if (la, t) not in set(keys)]
    if missing:
        out.append(
            f"summary.csv lacks {len(missing)} (layer, target) row(s), e.g. layer {missing[0][0]} {missing[0][1]}"
        )
    if layers and layers != list(range(layers[-1] + 1)):
        gaps = sorted(set(range(layers[-1] + 1)) - set(layers))
        out.append(f"summary.csv has no row for layer(s) {', '.join(map(str, gaps[:5]))}")
    return out


def _against_record(run_dir: Path, df, tables: dict) -> list[str]:
    out = []
    n_layers, targets = df["layer"].nunique(), sorted({str(t) for t in df["target"]})
    if (len(df), n_layers) != (tables.get("rows"), tables.get("layers")):
        out.append(
            f"summary.csv holds {len(df)} rows over {n_layers} layers; meta.json says "
            f"{tables.get('rows')} rows over {tables.get('layers')} layers"
        )
    if tables.get("targets") and targets != tables["targets"]:
        out.append(f"summary.csv's targets {targets} are not meta.json's {tables['targets']}")
    for name in TABLES:
        rec, p = tables.get(name), run_dir / name
        if not isinstance(rec, dict):
            continue
        if not p.is_file():
            out.append(f"{name} is missing")
        elif _file_stamp(p) != rec:
            out.append(
                f"{name} is not the file meta.json recorded (SHA-256 differs: edited, damaged, or from another run)"
            )
    return out


def _parquet(run_dir: Path, df) -> list[str]:
    p = run_dir / "summary.parquet"
    if not p.is_file():
        return []
    import pandas as pd

    try:
        pq = pd.read_parquet(p)
    except ImportError:
        return []  # no pyarrow here: the recorded SHA-256 still speaks for it
    except Exception as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return [f"summary.parquet is unreadable ({why})"]
    if len(pq) != len(df):
        return [f"summary.parquet has {len(pq)} rows, summary.csv {len(df)}"]
    return []
