"""Resident memory the monitor adds to a vLLM engine's processes: yours, the engine core's, the worker's (issue 57).

SmolLM2-135M (``bench_vllm.smollm2_folder``), float32, eager, one engine in this process (vLLM's default:
the engine core and its worker, which holds the model runner, in child processes). The modules the monitor's
path imports are imported first, then the RSS of every process is read; then a monitor is entered, 16
requests x (64 + 16) tokens generated inside it, its table and ``requests()`` read; then the RSS again. What
is printed is each process's growth beside the checkpoint's size on disk (anonymous and file-backed apart;
the goal is at most 10 % of it), and the mappings that grew most (``/proc/PID/smaps``). The modules the table
imports (pandas, scipy.stats) are imported before the first reading: they are modules imported, not the
monitor's memory.

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


def maps(pid: int) -> dict[str, int]:
    """Resident bytes by mapping (``/proc/PID/smaps``): a file's path, ``[heap]``, or ``[anon]`` for the rest."""
    out: dict[str, int] = {}
    name = "[anon]"
    with open(f"/proc/{pid}/smaps") as fh:
        for ln in fh:
            head = ln.split()
            if not head[0].endswith(":"):  # a mapping's first line: range perms offset dev inode [path]
                name = head[5] if len(head) > 5 else "[anon]"
            elif head[0] == "Rss:":
                out[name] = out.get(name, 0) + int(head[1]) * 1024
    return out


def grown(before: dict[str, int], after: dict[str, int], top: int = 4, shrank: bool = False) -> str:
    """The mappings that grew most (``shrank``: that shrank most), in MB."""
    d = sorted(((after.get(k, 0) - before.get(k, 0), k) for k in set(before) | set(after)), reverse=not shrank)
    return ", ".join(f"{Path(k).name or k} {v / MB:+.0f}" for v, k in d[:top] if abs(v) >= MB and (v < 0) == shrank)


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
    before, before_maps = rss(pids), {p: maps(p) for p in pids}
    with eh.monitor(llm, null_draws=19) as mon:
        llm.generate(prompts(2, vocab), sp, use_tqdm=False)
    table, rows = mon.summary(), mon.requests()
    after, after_maps = rss(pids), {p: maps(p) for p in pids}
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
        print(f"      grew most (MB): {grown(before_maps[p], after_maps[p])}")
        if less := grown(before_maps[p], after_maps[p], shrank=True):  # memory freed before the monitor, given
            print(f"      shrank most (MB): {less}")  # back by its heap trim (malloc_trim), nets out of the growth
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
