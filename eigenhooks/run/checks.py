"""The main job's checks: its arguments before any work, its table after, and what an interrupt is.

Each refuses in one line that names the flag or the layers, and says what to give instead.
"""

from __future__ import annotations

import math

import torch


def check_nulls(nulls: dict | None) -> dict:
    """The monitor's null settings: its defaults (``MonitorConfig``) with those given, checked by
    ``MonitorConfig`` itself (one place says what is valid); unknown names refused, all before any work."""
    from ..monitor.config import DEFAULTS, MonitorConfig
    from ..monitor.measures import NULL_SETTINGS

    full = {k: getattr(DEFAULTS, k) for k in NULL_SETTINGS}
    unknown = sorted(set(nulls or {}) - set(full))
    if unknown:
        raise ValueError(f"unknown null settings {unknown}; expected some of {sorted(full)}")
    full.update({k: v for k, v in (nulls or {}).items() if v is not None})
    MonitorConfig(**full)  # raises ValueError naming the setting
    return full


def check_device(device: str | None) -> None:
    """A device torch knows and this machine has, else one line that says which (not torch's own list)."""
    if device is None:
        return
    try:
        d = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"--device {device!r} is not a device: give cpu, cuda, cuda:1, mps ...") from None
    if d.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ValueError(f"--device {device}: this torch sees no CUDA device (torch {torch.__version__}); use cpu")
        if d.index is not None and d.index >= n:
            raise ValueError(f"--device {device}: there are {n} CUDA device(s), cuda:0 to cuda:{n - 1}")


def check_sizes(max_tokens, batch_size, dist_timeout) -> None:
    for flag, v in (("--max-tokens", max_tokens), ("--batch-size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{flag} must be a positive integer, got {v!r}")
    if isinstance(dist_timeout, bool) or not isinstance(dist_timeout, int | float) or not 0 < dist_timeout < math.inf:
        raise ValueError(f"--dist-timeout must be a positive number of seconds, got {dist_timeout!r}")


def check_finite(summary, model: str) -> None:
    """Tokens skipped for non-finite activations are said: a warning per run, or an error if no token was left.

    A token whose activations are NaN or inf at a reading point is left out of every sum (``n_nonfinite``);
    NaN in one weight makes every token non-finite from that layer on, and a table of '0 tokens' would read
    as 'indistinguishable'.
    """
    import warnings

    from ..monitor import MeasurementWarning

    if summary is None or not len(summary) or "n_nonfinite" not in summary.columns:
        return
    skipped = summary[summary["n_nonfinite"] > 0]
    if skipped.empty:
        return
    layers = sorted({int(x) for x in skipped["layer"]})
    shown = ", ".join(map(str, layers[:5])) + (", ..." if len(layers) > 5 else "")
    worst = skipped.loc[skipped["n_nonfinite"].idxmax()]
    said = (
        f"{model}: tokens with NaN or inf activations were left out at {len(layers)} layer(s) ({shown}; up to "
        f"{int(worst['n_nonfinite'])} at layer {int(worst['layer'])}): NaN or inf in the weights, or an overflow "
        "in the dtype (try --dtype float32)"
    )
    if int(summary["n_tokens"].max()) == 0:
        raise ValueError(f"no token was measured: {said}")
    warnings.warn(said, MeasurementWarning, stacklevel=3)


def causes(e: BaseException | None):
    """``e``, then what it was raised because of or while handling, and so on (each once)."""
    seen = set()
    while e is not None and id(e) not in seen:
        yield e
        seen.add(id(e))
        e = e.__cause__ or e.__context__


def interrupted(e: BaseException | None) -> bool:
    """Whether ``e`` is, or was raised while handling or because of, a KeyboardInterrupt (a library that
    wraps the interrupt in its own error, as transformers' lazy imports do, still means Ctrl-C)."""
    return any(isinstance(x, KeyboardInterrupt) for x in causes(e))


def installed_version(pkg: str) -> str:
    """The installed version of a distribution, or 'not installed' (run folders and ``--version`` say it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return "not installed"
