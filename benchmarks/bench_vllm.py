"""Tokens/s of a plain vLLM engine against a monitored one, paired, in alternating subprocesses.

SmolLM2-135M (the fetched GGUF, converted once to a safetensors folder by ``eigenhooks.zoo.gguf.convert``)
serves 16 requests of 64 prompt tokens + 64 generated tokens (greedy, ``ignore_eos``), in eager mode
(``enforce_eager=True``) and in vLLM's default compiled mode. Each engine runs in a fresh subprocess
(its start is not timed: one warm-up request first, then ``--repeats`` timed batches of fresh prompts,
the median kept), the two arms alternating (A B, B A, ...) so drift and a warming compile cache
fall on both. The ratio printed is time(B) / time(A), i.e. tokens/s(A) / tokens/s(B): above 1, B is slower.

Arms: ``plain`` (no eigenhooks), ``optin`` (``additional_config={"eigenhooks": {...}}``, no monitor
entered: what an opted-in engine costs idle), ``monitored`` (opted in, and ``llm.generate`` inside
``with eh.monitor(llm)``). ``--against plain`` runs plain against plain: a check of the harness
(ratio ~1). An arm that needs the opt-in fails with one line when eigenhooks' vLLM plugin is not
installed or ``eh.monitor`` cannot attach to the engine.

Goal (issue 49), on this CPU: compiled <= 1.05, eager <= 1.10. On a GPU with CUDA graphs: <= 1.05
(unmeasured here: the lent device has no vLLM). Measured 2026-12-07, 2-core CPU, nothing else running,
``--rounds 4 --repeats 3``: eager 1.016, compiled 1.028, eager opted in and idle 1.033 (identical
arms differ by up to 6% here); docs/vllm.md has the table. Again on issue 57's branch, holding a heavy slot
with another job in the other (load 3.5-3.9): eager 1.033 (rounds 1.006, 1.106, 1.030), opted in and idle
0.964 (rounds 0.912, 1.020): under load the rounds' spread exceeds the monitor's cost. With the verdict's sample
(issue 56) and its merge batched, the sample kept in the worker (issue 57), ``--modes eager --rounds 3
--repeats 3`` with another job in the other slot (load 2.9-3.6): eager 1.046 (rounds 1.074, 1.034, 1.046),
``read_s`` 48-54 s (the verdict's columns, computed in the worker, which vLLM binds to one core); compiled,
``--rounds 2 --repeats 2`` beside another session's engine (load 3.5-4.6): 1.108 (rounds 1.072, 1.152). Quiet
(2026-12-07 22:52-23:12, nothing else running, load 1.0-1.5), ``--modes compiled --rounds 3 --repeats 2``:
compiled 0.967 (rounds 1.059, 0.896, 0.952; the plain arm's own batches spread 10.3-12.9 s).
Eager, quiet, twice on one code (23:39, 23:49): 1.078 (rounds 0.972, 1.078, 1.056), 1.006 (rounds 1.032, 1.028,
0.963, 0.990): a run is one draw from a spread of about +-5 % here.

Usage: python benchmarks/bench_vllm.py [--modes eager,compiled] [--against monitored|optin|plain]
       [--rounds 2] [--repeats 2]   (run under `flock /tmp/eigenhooks-heavy.lock`; the vllm venv)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
N_REQUESTS, PROMPT, GENERATED = 16, 64, 64
ENGINE = dict(dtype="float32", gpu_memory_utilization=0.1, max_model_len=512, seed=0)
OPT_IN = {"eigenhooks": {}}  # additional_config key the eigenhooks vLLM plugin reads


def smollm2_folder() -> Path:
    """SmolLM2-135M as a safetensors folder (converted once from the fetched GGUF, then cached)."""
    import eigenhooks as eh
    from eigenhooks.zoo import gguf, real

    try:
        path = real.require("smollm2-135m")
    except eh.zoo.FetchError as e:
        sys.exit(f"bench_vllm: {e}")
    return gguf.convert(path, sha256=real.entry("smollm2-135m").sha256)


def prompts(seed: int, vocab: int):
    """16 prompts of 64 random token ids (seeded: both arms get the same ones; fresh per repeat, so no
    prefix cache hit)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, vocab - 100, (N_REQUESTS, PROMPT), generator=g)
    return [{"prompt_token_ids": row.tolist()} for row in ids]


def child(folder: str, mode: str, arm: str, repeats: int) -> dict:
    """Start one engine, warm it up, time ``repeats`` batches; return the timings (runs in a subprocess).

    The monitored arm enters ``eh.monitor(llm)`` once, before the warm-up, and times each batch's
    ``generate`` inside it: what serving costs while monitored. Entering (the spectra, the worker's
    taps armed) and reading the table back (``summary``) are timed apart, as ``enter_s``/``read_s``."""
    from vllm import LLM, SamplingParams

    kw = dict(ENGINE, enforce_eager=(mode == "eager"))
    if arm != "plain":
        _require_plugin()
        kw["additional_config"] = OPT_IN
    t0 = time.perf_counter()
    llm = LLM(model=folder, **kw)
    start_s = time.perf_counter() - t0
    vocab = llm.llm_engine.model_config.get_vocab_size()
    sp = SamplingParams(temperature=0.0, max_tokens=GENERATED, ignore_eos=True)
    extra = {}
    with _entered(llm, arm, extra):
        llm.generate(prompts(10_000, vocab)[:2], sp, use_tqdm=False)  # warm-up: first-batch costs, a lazy compile
        times = []
        for r in range(repeats):
            batch = prompts(r, vocab)
            t = time.perf_counter()
            outs = llm.generate(batch, sp, use_tqdm=False)
            times.append(time.perf_counter() - t)
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            if n != N_REQUESTS * GENERATED:
                raise SystemExit(f"bench_vllm: generated {n} tokens, expected {N_REQUESTS * GENERATED}")
    res = {"mode": mode, "arm": arm, "start_s": start_s, "times": times, "median_s": statistics.median(times)}
    return {**res, **extra}


def _require_plugin() -> None:
    from importlib.metadata import entry_points

    names = [e.name for e in entry_points(group="vllm.general_plugins")]
    if not any("eigenhooks" in n for n in names):
        raise SystemExit(
            "bench_vllm: the monitored arm needs eigenhooks' vLLM opt-in (a 'vllm.general_plugins' entry point "
            f"named eigenhooks; found {names or 'none'}): pip install -e . in this venv, on a branch that has it, "
            "or run --against plain"
        )


@contextlib.contextmanager
def _entered(llm, arm: str, extra: dict):
    """Inside ``eh.monitor(llm)`` for the monitored arm (nothing for the others); on leaving, checks that it
    counted every generated token's forward and times reading its table back."""
    if arm != "monitored":
        yield
        return
    import eigenhooks as eh

    t = time.perf_counter()
    try:
        mon = eh.monitor(llm)
    except Exception as e:
        raise SystemExit(f"bench_vllm: eh.monitor cannot attach to the opted-in engine: {e}") from e
    with mon:
        extra["enter_s"] = time.perf_counter() - t
        yield
    t = time.perf_counter()
    n = mon.summary()["n_tokens"].iloc[0]
    extra["read_s"] = time.perf_counter() - t
    if n <= 0:
        raise SystemExit("bench_vllm: the monitored engine counted no tokens")


def in_subprocess(folder: Path, mode: str, arm: str, repeats: int) -> dict:
    """One engine's timings; the child writes them to a file (vLLM logs to stdout, also at exit)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--child", str(folder), mode, arm, str(repeats), str(out)]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        if p.returncode != 0 or not out.exists():
            sys.exit(f"bench_vllm: the {mode} {arm} engine failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
        return json.loads(out.read_text())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        folder, mode, arm, repeats, out = sys.argv[2:7]
        Path(out).write_text(json.dumps(child(folder, mode, arm, int(repeats))))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--against", default="monitored", choices=["monitored", "optin", "plain"])
    ap.add_argument("--rounds", type=int, default=2, help="pairs of engine runs per mode (orders alternate)")
    ap.add_argument("--repeats", type=int, default=2, help="timed batches per engine (median kept)")
    args = ap.parse_args()
    folder = smollm2_folder()
    tokens = N_REQUESTS * (PROMPT + GENERATED)
    print(f"SmolLM2-135M ({folder}), {N_REQUESTS} requests x ({PROMPT} + {GENERATED}) tokens, float32, CPU")
    print(f"plain (A) vs {args.against} (B); {args.rounds} rounds, orders alternating; {args.repeats} timed batches")
    for mode in args.modes.split(","):
        a, b = [], []
        for r in range(args.rounds):
            order = [("plain", a), (args.against, b)]
            for arm, into in order if r % 2 == 0 else order[::-1]:
                res = in_subprocess(folder, mode, arm, args.repeats)
                into.append(res["median_s"])
                more = "".join(f"  {k} {res[k]:.2f} s" for k in ("enter_s", "read_s") if k in res)
                print(
                    f"  {mode:8s} {arm:9s} start {res['start_s']:6.1f} s  batches {_fmt(res['times'])}{more}",
                    flush=True,
                )
        ta, tb = statistics.median(a), statistics.median(b)
        print(
            f"{mode:8s} A {tokens / ta:7.1f} tok/s  B {tokens / tb:7.1f} tok/s  "
            f"time ratio B/A {tb / ta:.3f}  (per round: {_fmt([y / x for x, y in zip(a, b)], 3)})"
        )


def _fmt(xs, digits: int = 2) -> str:
    return " ".join(f"{x:.{digits}f}" for x in xs)


if __name__ == "__main__":
    main()
