"""What entering the monitor costs, against numpy's full eig of the same layers' small sides.

Builds ``--layers`` Llama-3.2-1B-shaped attention layers (d = 2048, 32 heads, 8 kv groups of 64:
small side V O is 512 x 512; random weights, a tiny MLP and vocabulary, which the monitor never
reads) and times, in one run, alternating ``--rounds`` times:

- numpy: ``numpy.linalg.eig`` (values and vectors) of each layer's V O, one after the other;
- cold: ``eh.monitor(model).__enter__()`` with an empty disk cache and an empty in-process memo
  (spectra under both ranking rules, eigen-subspaces, Haar and F-null frames, reducers);
- warm: the same with the disk cache filled (a fresh process's second run).

Prints the medians and cold / numpy, the issue's bar (<= 3).

Usage: python benchmarks/bench_entry.py [--layers 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    import numpy as np
    import torch
    import transformers as T

    import eigenhooks as eh
    from eigenhooks.spectra import clear_memo, layer_stacked

    cfg = T.LlamaConfig(
        hidden_size=2048,
        intermediate_size=64,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        num_hidden_layers=a.layers,
        vocab_size=256,
    )
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(cfg).eval()
    ad = eh.get_adapter(model)
    sides = []
    for i in range(a.layers):
        O, V = layer_stacked(ad, i)
        sides.append((V @ O).numpy())  # (512, 512)
    print(
        f"{a.layers} Llama-1B-shaped layers, small side {sides[0].shape}; torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}"
    )

    def enter() -> float:
        mon = eh.monitor(model)
        t = time.perf_counter()
        mon.__enter__()
        dt = time.perf_counter() - t
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", eh.MeasurementWarning)  # entered to be timed, no forward
            mon.__exit__(None, None, None)
        return dt

    res: dict[str, list[float]] = {"numpy": [], "cold": [], "warm": []}
    for _ in range(a.rounds):
        t = time.perf_counter()
        for M in sides:
            np.linalg.eig(M)
        res["numpy"].append(time.perf_counter() - t)
        os.environ["EIGENHOOKS_CACHE"] = tempfile.mkdtemp(prefix="eh-bench-entry-")
        clear_memo()
        res["cold"].append(enter())
        clear_memo()
        res["warm"].append(enter())
    med = {k: statistics.median(v) for k, v in res.items()}
    print(
        f"numpy eig x{a.layers}: {med['numpy']:.2f} s; entry cold {med['cold']:.2f} s; entry warm (disk cache) {med['warm']:.2f} s"
    )
    print(f"cold / numpy = {med['cold'] / med['numpy']:.2f} (bar <= 3); rounds {a.rounds}: {res}")


if __name__ == "__main__":
    main()
