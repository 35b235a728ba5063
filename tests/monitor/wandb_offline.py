"""Read an offline wandb run back: its ``run-*.wandb`` file, decoded with wandb's own protobuf records.

wandb (0.31) ships no Python reader for the .wandb file (the old ``wandb.sdk.internal.datastore``
is gone; its Go core reads them). The file is wandb's LevelDB-style log: a 7-byte header
(``:W&B``, magic 0xBEE1, version), then 32 KiB blocks of chunks, each with a 7-byte header
(CRC-32C, length, type FULL/FIRST/MIDDLE/LAST). This module undoes only that framing; every
record is parsed by ``wandb.proto.wandb_internal_pb2.Record``, wandb's own message type.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _chunks(data: bytes):
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    if ident != b":W&B" or magic != 0xBEE1:
        raise ValueError(f"not a .wandb file: header {data[:7]!r}")
    pos, parts = 7, []
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:  # zero padding to the block's end
            pos += left
            continue
        body = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == FULL:
            yield body
        elif kind == FIRST:
            parts = [body]
        elif kind == MIDDLE:
            parts.append(body)
        elif kind == LAST:
            yield b"".join([*parts, body])
            parts = []
        else:
            raise ValueError(f"unknown chunk type {kind} at byte {pos}")


def records(path):
    """Every ``Record`` of a .wandb file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    for raw in _chunks(Path(path).read_bytes()):
        rec = pb.Record()
        rec.ParseFromString(raw)
        yield rec


def history(run_dir) -> list[dict]:
    """The history rows (what ``run.log`` logged) of the offline run in ``run_dir``: {key: value}."""
    (path,) = Path(run_dir).glob("run-*.wandb")
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append({it.key or "/".join(it.nested_key): json.loads(it.value_json) for it in rec.history.item})
    return rows


def metric_definitions(run_dir) -> list:
    """The ``define_metric`` records of the run."""
    (path,) = Path(run_dir).glob("run-*.wandb")
    return [rec.metric for rec in records(path) if rec.WhichOneof("record_type") == "metric"]
