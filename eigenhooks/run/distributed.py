"""torch.distributed for ``eigenhooks run`` under torchrun: who am I, which device, gather counts.

``setup(device)`` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK), starts the
process group when torchrun started several processes and nobody started it yet (gloo on
CPU, NCCL on CUDA), and picks this rank's device (``cuda:LOCAL_RANK`` for CUDA).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

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
