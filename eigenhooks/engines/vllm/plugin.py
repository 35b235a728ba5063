"""The opt-in: a ``vllm.general_plugins`` entry point that vLLM runs in each of its processes.

``register`` wraps ``EngineArgs.create_engine_config``. For an engine built with
``additional_config={"eigenhooks": {...}}`` (``--additional-config '{"eigenhooks": {...}}'`` on the
server) the wrap checks what eigenhooks cannot measure (one line each, before anything loads) and names
``worker.EigenhooksWorker`` as the worker extension; vLLM's workers then import it, which places the taps
when the model loads. The key is part of ``additional_config``, which vLLM hashes into its config hash,
so its compile cache keeps monitored and plain graphs apart; the wrap adds the taps' version (``TAPS``)
under it, so graphs compiled with another version's taps stay apart too. Without the key the wrap passes the call on
untouched and nothing of eigenhooks is imported by the engine.

Import nothing heavy here: vLLM loads this module in every process, for every engine.
"""

from __future__ import annotations

import os

KEY = "eigenhooks"
EXTENSION = "eigenhooks.engines.vllm.worker.EigenhooksWorker"
OPTIONS = {"out", "settings"}  # out: the served sink's folder; settings: a served monitor's eh.monitor settings
TAPS = 3  # the taps' layout and their op's signature (capture.py): bump on any change to either
TAPS_KEY = "_taps"  # where the opt-in records TAPS in the options, so it enters vLLM's config hash


class EigenhooksConfigError(ValueError):
    """An engine opted in to eigenhooks with something eigenhooks cannot measure."""


def check_args(args) -> None:
    """Refuse, in one line each, what an opted-in engine cannot measure.

    Raises:
        EigenhooksConfigError: unknown options, speculative decoding, LoRA, pipeline parallel, or a
            worker extension of the user's own.
    """
    opts = args.additional_config.get(KEY)
    if not isinstance(opts, dict):
        raise EigenhooksConfigError(f"additional_config['eigenhooks'] must be a dict of options, got {opts!r}")
    unknown = sorted(set(opts) - OPTIONS - {TAPS_KEY})
    if unknown:
        raise EigenhooksConfigError(f"unknown eigenhooks options {unknown}; known: {sorted(OPTIONS)}")
    check_options(opts)
    if args.speculative_config:
        raise EigenhooksConfigError(
            "eigenhooks does not measure speculative decoding (draft tokens the target rejects are computed "
            "and dropped, so positions would count twice): build the engine without speculative_config"
        )
    if args.enable_lora:
        raise EigenhooksConfigError(
            "eigenhooks does not measure LoRA engines (each adapter changes o_proj/v_proj, so F differs per "
            "request): build the engine without enable_lora, or merge the adapter into the checkpoint"
        )
    if int(args.pipeline_parallel_size or 1) > 1:
        raise EigenhooksConfigError(
            "eigenhooks does not measure pipeline parallel engines (each stage holds part of the layers): "
            "use tensor parallel (tensor_parallel_size) or pipeline_parallel_size=1"
        )
    ext = args.worker_extension_cls
    if ext and ext != EXTENSION:
        raise EigenhooksConfigError(
            f"eigenhooks needs the worker extension {EXTENSION}, but worker_extension_cls={ext!r} was given; "
            "drop one of them"
        )


def settings_from_wire(settings: dict) -> dict:
    """``eh.monitor``'s settings as they came through msgpack (tuples arrive as lists)."""
    out = dict(settings)
    if "targets" in out and out["targets"] is not None:
        out["targets"] = [tuple(t) if isinstance(t, list) else t for t in out["targets"]]
    if "reading_points" in out and isinstance(out["reading_points"], list):
        out["reading_points"] = tuple(out["reading_points"])
    return out


def check_options(opts: dict) -> None:
    """``out`` a folder this process can write (made if missing), ``settings`` ``eh.monitor``'s: checked here,
    where the engine is built (the process that builds ``LLM``, the API server at startup), not in a worker
    after the model loaded.

    Raises:
        EigenhooksConfigError: one line naming the option (and the setting) at fault.
    """
    from pathlib import Path

    out = opts.get("out")
    if out is not None:
        if not isinstance(out, str) or not out:
            raise EigenhooksConfigError(f"eigenhooks option 'out' must be a folder path, got {out!r}")
        try:
            Path(out).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise EigenhooksConfigError(f"eigenhooks option 'out': cannot make the folder {out!r}: {e}") from None
        if not os.access(out, os.W_OK | os.X_OK):
            raise EigenhooksConfigError(f"eigenhooks option 'out': the folder {out!r} is not writable")
    settings = opts.get("settings")
    if settings is None:
        return
    if not isinstance(settings, dict):
        raise EigenhooksConfigError(
            f"eigenhooks option 'settings' must be a dict of eh.monitor's settings, got {settings!r}"
        )
    if "sink" in settings:
        raise EigenhooksConfigError("eigenhooks option 'settings' cannot hold 'sink': a served engine writes 'out'")
    from ...monitor.facade import make_config

    try:
        make_config((), settings_from_wire(settings))
    except (TypeError, ValueError) as e:
        msg = " ".join(str(e).split())
        raise EigenhooksConfigError(f"eigenhooks option 'settings': {msg}") from None


_WARNED: set[str] = set()


def warn_ids() -> None:
    """Once a process: with vLLM's request id randomisation off, requests that share an id are one to the engine."""
    import warnings

    if os.environ.get("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "0") not in ("", "0") and "ids" not in _WARNED:
        _WARNED.add("ids")
        warnings.warn(
            "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION is set: requests that share an id are one request to vLLM "
            "and to eigenhooks (counted once); give each request its own id",
            stacklevel=3,
        )


def _wrap(cls) -> None:
    inner = cls.create_engine_config
    if getattr(inner, "_eigenhooks", False):
        return

    def create_engine_config(self, *args, **kwargs):
        extra = self.additional_config
        if not (isinstance(extra, dict) and KEY in extra):
            return inner(self, *args, **kwargs)
        check_args(self)
        warn_ids()
        # the taps' version joins the config hash: a graph compiled with other taps is not reused
        self.additional_config = {**extra, KEY: {**extra[KEY], TAPS_KEY: TAPS}}
        self.worker_extension_cls = EXTENSION
        config = inner(self, *args, **kwargs)
        from ...models.vllm import check_architecture

        check_architecture(config.model_config.architectures)
        return config

    create_engine_config._eigenhooks = True
    cls.create_engine_config = create_engine_config


def register() -> None:
    """The entry point vLLM calls in each process (possibly more than once)."""
    from vllm.engine.arg_utils import EngineArgs

    _wrap(EngineArgs)


__all__ = ["EXTENSION", "KEY", "EigenhooksConfigError", "check_args", "check_options", "register", "settings_from_wire"]
