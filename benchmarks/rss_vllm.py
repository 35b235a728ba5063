"""Resident memory the monitor adds to a vLLM engine's processes: the user's and the engine core's (issue 57).

SmolLM2-135M (``bench_vllm.smollm2_folder``), float32, eager, one engine in this process (vLLM's default:
the engine core, which holds the model runner, in a child process). The modules the monitor's path imports
are imported first, then the RSS of both processes is read; then a monitor is entered, 16 requests x
(64 + 16) tokens generated inside it, its table and ``requests()`` read; then the RSS again. What is
printed is each process's growth beside the checkpoint's size on disk (anonymous and file-backed apart); the
goal is at most 10 % of it. The modules the table imports (pandas, scipy.stats) are imported before the
first reading: they are modules imported, not the monitor's memory.

Usage: python benchmarks/rss_vllm.py   (the vllm venv, holding a heavy slot: /work/bin/heavy ...)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MB = 1 << 20


def rss(pids) -> dict[int, tuple[int, int]]:
    """Each process's (anonymous, file-backed) resident bytes (``RssAnon``, ``RssFile`` + ``RssShmem``)."""
    out = {}
    for p in pids:
        with open(f"/proc/{p}/status") as fh:
            kb = {ln.split(":")[0]: int(ln.split()[1]) for ln in fh if ln.startswith("Rss")}
        out[p] = (kb["RssAnon"] * 1024, (kb["RssFile"] + kb["RssShmem"]) * 1024)
    return out


def main() -> None:
    import pandas  # noqa: F401  (the modules the table imports: summary() imports them)
    import psutil
    import scipy.stats  # noqa: F401
    import transformers  # noqa: F401  (imported by vLLM anyway; the monitor's path may import its models)
    from bench_vllm import ENGINE, OPT_IN, prompts, smollm2_folder
    from vllm import LLM, SamplingParams

    import eigenhooks as eh
    import eigenhooks.engines.vllm.monitor  # noqa: F401  (the modules the monitor's path imports)
    import eigenhooks.monitor  # noqa: F401

    folder = smollm2_folder()
    size = sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))
    llm = LLM(model=str(folder), enforce_eager=True, additional_config=OPT_IN, **ENGINE)
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    llm.generate(prompts(1, vocab), sp, use_tqdm=False)  # warm: first-batch costs on both sides
    core = [c.pid for c in psutil.Process().children(recursive=True) if c.memory_info().rss > 200 * MB]
    pids = [os.getpid(), *core]
    before = rss(pids)
    with eh.monitor(llm, null_draws=19) as mon:
        llm.generate(prompts(2, vocab), sp, use_tqdm=False)
    table, rows = mon.summary(), mon.requests()
    after = rss(pids)
    assert int(table["n_tokens"].iloc[0]) == 16 * (64 + 15) and len(rows) > 0
    print(f"SmolLM2-135M, float32, eager; checkpoint {size / MB:.0f} MB; 10 % of it: {size / MB / 10:.0f} MB")
    for p in pids:
        who = "main" if p == os.getpid() else f"{psutil.Process(p).name()} (pid {p})"  # VLLM::EngineCore, ::Worker
        b, a = sum(before[p]), sum(after[p])
        grew = (a - b) / MB
        anon, file = ((after[p][j] - before[p][j]) / MB for j in (0, 1))
        print(
            f"  {who:26s} RSS {b / MB:7.0f} -> {a / MB:7.0f} MB  (+{grew:.0f} MB, {grew / (size / MB):.1%}; "
            f"anonymous {anon:+.0f} MB, file-backed {file:+.0f} MB)"
        )
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
