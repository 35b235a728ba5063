"""torch.distributed for ``eigenhooks run`` under torchrun: who am I, which device, gather counts and lines.

``setup(device)`` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK), starts the
process group when torchrun started several processes and nobody started it yet (gloo on
CPU, NCCL on CUDA), and picks this rank's device (``cuda:LOCAL_RANK`` for CUDA).
``gather_ints`` and ``gather_jsonl`` bring every rank's counts and per-forward lines to rank 0.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from itertools import islice
from pathlib import Path

import torch

log = logging.getLogger(__name__)


@dataclass
class Context:
    """This process's place in the job: rank, world size and the device to load the model on."""

    rank: int = 0
    world: int = 1
    device: str | None = None


def setup(device: str | None = None, timeout: float = 300.0) -> Context:
    """The distributed context of this process (rank 0 of 1 outside torchrun).

    Args:
        device: the device asked for (``cpu``, ``cuda``, ``cuda:1`` ...), or None.
        timeout: seconds to wait for the other ranks, at the start and at every collective.

    Raises:
        RuntimeError: torchrun's WORLD_SIZE and torch.distributed's disagree, torchrun's
            variables are incomplete, or the other ranks did not come within ``timeout``.
    """
    import torch.distributed as dist

    env_world = _env_int("WORLD_SIZE", 1)
    started = dist.is_available() and dist.is_initialized()
    if not started and env_world > 1:
        if not dist.is_available():
            raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed; run one process")
        _start_group(env_world, (device or "").startswith("cuda"), timeout)
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


def _env_int(name: str, default: int | None = None) -> int:
    v = os.environ.get(name)
    if v is None and default is not None:
        return default
    try:
        return int(v)
    except (TypeError, ValueError):
        raise RuntimeError(f"{name}={v!r} is not an integer: torchrun sets it; unset it to run one process") from None


def _start_group(world: int, cuda: bool, timeout: float) -> None:
    """init_process_group from torchrun's variables, saying what it waits for, and failing in one line.

    Waiting more than a second prints ``waiting for N ranks at ADDR:PORT`` on stderr; torch's
    own C++ log lines of the rendezvous are kept off stderr (logged at DEBUG if it fails).
    """
    import torch.distributed as dist

    missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
    if missing:
        raise RuntimeError(
            f"WORLD_SIZE={world} asks for {world} processes, but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set: start them with torchrun --nproc-per-node {world}, "
            "or unset WORLD_SIZE to run one process"
        )
    rank = _env_int("RANK")
    if not 0 <= rank < world:
        raise RuntimeError(f"RANK={rank} is not in 0..{world - 1} (WORLD_SIZE={world})")
    where = f"{os.environ['MASTER_ADDR']}:{_env_int('MASTER_PORT')}"
    waiting = f"eigenhooks: rank {rank}: waiting for {world} ranks at {where} (--dist-timeout {timeout:g} s)"
    t0, error, said = time.monotonic(), None, ""
    with _stderr_aside() as (stderr, captured), _say_after(1.0, waiting, stderr):
        # a client's own connect retries overrun the timeout (by up to twice it): wait for the master here
        if rank == 0 or _reachable(os.environ["MASTER_ADDR"], _env_int("MASTER_PORT"), t0 + timeout):
            try:
                dist.init_process_group(backend="nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout))
            except Exception as e:
                error, said = e, captured()
        else:
            error = dist.DistNetworkError(f"nothing listens at {where}")
    if error is None:
        return
    waited = time.monotonic() - t0
    log.debug("init_process_group failed after %.1f s: %r; torch said:\n%s", waited, error, said)
    if isinstance(error, dist.DistError) and waited >= 0.9 * timeout:
        raise RuntimeError(
            f"rank {rank} of {world}: no rendezvous at {where} within --dist-timeout {timeout:g} s "
            f"(the other ranks did not come): start all {world} with torchrun --nproc-per-node {world}, "
            "or unset WORLD_SIZE, RANK, MASTER_ADDR and MASTER_PORT to run one process"
        ) from error
    why = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
    raise RuntimeError(f"rank {rank} of {world}: torch.distributed did not start at {where}: {why}") from error


def _reachable(host: str, port: int, deadline: float) -> bool:
    """Whether something accepts a TCP connection at host:port before ``deadline`` (time.monotonic)."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(0.2, max(deadline - time.monotonic(), 0)))


@contextlib.contextmanager
def _stderr_aside():
    """File descriptor 2 into a temporary file while the block runs: yields (a copy of the real
    stderr's descriptor, a function returning what was written)."""
    sys.stderr.flush()
    real = os.dup(2)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 2)
        try:
            yield real, lambda: (f.seek(0), f.read().decode(errors="replace"))[1]
        finally:
            os.dup2(real, 2)
            os.close(real)


@contextlib.contextmanager
def _say_after(seconds: float, line: str, fd: int):
    """Write ``line`` to ``fd`` if the block is still running after ``seconds``."""
    timer = threading.Timer(seconds, lambda: os.write(fd, (line + "\n").encode()))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()  # never writes once the block is over (fd may be closed then)


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
