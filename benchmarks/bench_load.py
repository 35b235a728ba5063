"""First vs second load of a GGUF model (the model cache), and what verifying the files costs.

Every load runs in a fresh process, as ``eigenhooks run file.gguf`` does, with a private
``EIGENHOOKS_CACHE`` (the shared cache is never touched): the first load converts the file
(transformers dequantises the weights and builds the tokenizer) into the cache, the second reads
the converted copy. Only ``eh.load_model`` is timed; the process has already imported eigenhooks,
transformers and the Llama classes (imports cost the same with or without the cache).

Cases: a tiny Llama written here with the ``gguf`` writer (tests/zoo/gguf_tiny.py), and SmolLM2-135M
if ``eigenhooks fetch smollm2-135m`` has run (its .gguf is copied into the private cache, loaded
by name, so the pinned SHA-256 is checked as on any load). For SmolLM2 also: the second load
with the stamps dropped (every file hashed again: the check's full cost), and the check alone
(``real.require`` + ``store.verify``) with and without stamps.

Usage: python benchmarks/bench_load.py [--rounds 3] [--skip-real]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRELUDE = (
    "import time, eigenhooks as eh, transformers\n"
    "from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM\n"
)


def in_fresh_process(code: str, cache: Path) -> str:
    env = {**os.environ, "EIGENHOOKS_CACHE": str(cache), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    env.pop("EIGENHOOKS_MODELS", None)
    p = subprocess.run([sys.executable, "-c", PRELUDE + code], capture_output=True, text=True, env=env, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-2000:])
    return p.stdout.strip().splitlines()[-1]


def timed_load(spec: str, cache: Path) -> float:
    return float(
        in_fresh_process(f"t = time.perf_counter(); eh.load_model({spec!r}); print(time.perf_counter() - t)", cache)
    )


def first_and_second(spec: str, cache: Path, rounds: int) -> tuple[float, list[float]]:
    first = timed_load(spec, cache)
    return first, [timed_load(spec, cache) for _ in range(rounds)]


def report(name: str, first: float, second: list[float]) -> None:
    med = statistics.median(second)
    print(
        f"{name}: first load {first:.2f} s, second load {med:.2f} s (median of {len(second)}; "
        f"min {min(second):.2f}): {100 * med / first:.1f}% of the first"
    )


CHECK = """
from eigenhooks.zoo import real, store, digest
def check():
    t = time.perf_counter()
    p = real.require("smollm2-135m")
    why = store.verify(store.entry_dir(real.entry("smollm2-135m").sha256), real.entry("smollm2-135m").sha256)
    assert why is None, why
    return time.perf_counter() - t
check()  # imports
cold = []
for _ in range(ROUNDS):
    import shutil; shutil.rmtree(digest.stamps_dir(), ignore_errors=True); digest.forget()
    cold.append(check())
warm = [check() for _ in range(ROUNDS)]
files = [real.require("smollm2-135m")] + sorted((store.entry_dir(real.entry("smollm2-135m").sha256)).iterdir())
print(min(cold), min(warm), sum(f.stat().st_size for f in files))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="second loads (and check rounds) per case")
    ap.add_argument("--skip-real", action="store_true", help="only the tiny GGUF")
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (timings on a shared machine move)")
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "zoo")]  # harness, and the writer beside its tests
    from gguf_tiny import write_tiny_gguf

    with tempfile.TemporaryDirectory(prefix="eh-bench-load-") as tmp:
        tmp = Path(tmp)
        tiny = tmp / "tiny.gguf"
        write_tiny_gguf(tiny)
        report("tiny Llama GGUF (2 layers, d=32)", *first_and_second(str(tiny), tmp / "cache-tiny", args.rounds))
        from eigenhooks.zoo import real

        if args.skip_real or not real.is_fetched("smollm2-135m"):
            print("SmolLM2: skipped (run `eigenhooks fetch smollm2-135m` first)")
            return
        cache = tmp / "cache-real"
        dest = cache / "models" / "smollm2-135m" / real.entry("smollm2-135m").filename
        dest.parent.mkdir(parents=True)
        shutil.copyfile(real.local_path("smollm2-135m"), dest)  # a private copy: the shared file stays as it is
        first, second = first_and_second("smollm2-135m", cache, args.rounds)
        report("SmolLM2-135M Q4_1 GGUF (30 layers, d=576)", first, second)
        unstamped = []
        for _ in range(args.rounds):
            shutil.rmtree(cache / "models" / "stamps", ignore_errors=True)
            unstamped.append(timed_load("smollm2-135m", cache))
        print(f"SmolLM2 second load with no stamps (every file hashed): {statistics.median(unstamped):.2f} s (median)")
        cold, warm, size = in_fresh_process(CHECK.replace("ROUNDS", str(args.rounds)), cache).split()
        print(
            f"SmolLM2 check alone (pin of the .gguf + manifest, sizes and SHA-256 of the converted copy, "
            f"{int(size) / 2**20:.0f} MB): {float(cold):.3f} s hashing everything, {1000 * float(warm):.1f} ms "
            "with stamps (stat only)"
        )


if __name__ == "__main__":
    main()
