"""torch.distributed for ``eigenhooks run`` under torchrun: who am I, which device, gather counts and lines.

``setup(device)`` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK), starts the
process group when torchrun started several processes and nobody started it yet (gloo on
CPU, NCCL on CUDA), and picks this rank's device (``cuda:LOCAL_RANK`` for CUDA).
``gather_ints`` and ``gather_jsonl`` bring every rank's counts and per-forward lines to rank 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import torch


@dataclass
class Context:
    """This process's place in the job: rank, world size and the device to load the model on."""

    rank: int = 0
    world: int = 1
    device: str | None = None


def setup(device: str | None = None) -> Context:
    """The distributed context of this process (rank 0 of 1 outside torchrun).

    Args:
        device: the device asked for (``cpu``, ``cuda``, ``cuda:1`` ...), or None.

    Raises:
        RuntimeError: torchrun's WORLD_SIZE and torch.distributed's disagree.
    """
    import torch.distributed as dist

    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    started = dist.is_available() and dist.is_initialized()
    if not started and env_world > 1:
        if not dist.is_available():
            raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed; run one process")
        cuda = (device or "").startswith("cuda")
        dist.init_process_group(backend="nccl" if cuda else "gloo")
        started = True
    if not started:
        return Context(0, 1, device)
    rank, world = dist.get_rank(), dist.get_world_size()
    if env_world not in (1, world):
        raise RuntimeError(f"WORLD_SIZE={env_world} but torch.distributed has {world} ranks")
    if device == "cuda" and torch.cuda.is_available():  # one GPU per rank
        local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    return Context(rank, world, device)


def gather_ints(x: int) -> list[int]:
    """x from every rank, in rank order (every rank gets the list)."""
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, int(x))
    return [int(v) for v in out]


def gather_jsonl(src: Path | None, dest: Path | None, chunk: int = 512) -> None:
    """Every rank's JSON lines (its file ``src``) into ``dest`` on rank 0, rank by rank, each line with its "rank".

    Collective: every rank calls it. Lines go to rank 0 in rounds of at most ``chunk`` per
    rank, so rank 0 holds ``world * chunk`` lines at a time, never a whole file; they wait in
    hidden per-rank files beside ``dest`` until ``dest`` is replaced at once. ``src`` may be
    ``dest`` (rank 0's own lines) or missing (no lines).

    Args:
        src: this rank's lines, one JSON object each.
        dest: the file rank 0 writes (ignored on other ranks).
        chunk: lines per rank per round.
    """
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    src = src if src is not None and src.exists() else Path(os.devnull)
    with open(src) as f:
        rounds = -(-max(gather_ints(sum(1 for _ in f))) // chunk)
    parts = [dest.with_name(f".{dest.name}.rank{r}") for r in range(world)] if rank == 0 else []
    try:
        with open(src) as f, contextlib.ExitStack() as stack:
            outs = [stack.enter_context(open(p, "w")) for p in parts]
            for _ in range(rounds):
                got: list | None = [None] * world if rank == 0 else None
                dist.gather_object(list(islice(f, chunk)), got, dst=0)
                for r, lines in enumerate(got or []):
                    outs[r].writelines(json.dumps({"rank": r, **json.loads(x)}) + "\n" for x in lines)
        if rank == 0:
            with open(parts[0], "ab") as out:  # rank 0's lines, then rank 1's ...
                for p in parts[1:]:
                    with open(p, "rb") as f:
                        shutil.copyfileobj(f, out)
            os.replace(parts[0], dest)
    finally:
        for p in parts:
            p.unlink(missing_ok=True)
