"""Layers side by side: how many cores, BLAS threads per worker, and a pool that may be no pool.

LAPACK's eig is mostly serial, so a model's layers are decomposed a few at a time in threads, each
with cores // workers BLAS threads (``spectra.compute``; the monitor's plan builds its layers alike).
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@contextmanager
def _blas_threads(n: int):
    """Limit the BLAS / LAPACK threads of torch and numpy/scipy to n while the layers run side by side,
    so that workers x BLAS threads never exceed the cores (oversubscribed BLAS dominated a GPU
    machine's entry: docs/scale.md, "Figures behind the code")."""
    before = torch.get_num_threads()
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # then numpy/scipy keep their own threads; torch's are still limited
        threadpool_limits = None
    torch.set_num_threads(n)
    try:
        if threadpool_limits is None:
            yield
        else:
            with threadpool_limits(limits=n):
                yield
    finally:
        torch.set_num_threads(before)


def parallel_map(fn, items, serial: bool = False) -> list:
    """[fn(x) for x in items], side by side in threads (cores // workers BLAS threads each) unless serial."""
    items = list(items)
    workers = max(1, min(len(items), _cores()))
    if serial or workers == 1:
        return [fn(x) for x in items]
    with _blas_threads(max(1, _cores() // workers)), ThreadPoolExecutor(workers) as ex:
        return list(ex.map(fn, items))


class _Inline:
    """A stand-in for ThreadPoolExecutor that runs each job at once, in the calling thread."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, fn, *args) -> Future:
        f: Future = Future()
        try:
            f.set_result(fn(*args))
        except Exception as e:  # delivered by result(), as a pool would
            f.set_exception(e)
        return f
