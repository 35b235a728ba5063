"""Does the verdict hang on its seeds, and what does summary() cost? SmolLM2 on the main job's text (issue 56).

    python benchmarks/verdict_seeds.py [--model smollm2-135m] [--seeds 0 1 2] [--max-tokens 4096] [--fixed]

Runs the model once under the monitor on the batches ``eigenhooks run`` feeds it (the bundled text), then makes
the table again from the same kept tokens with other ``null_seed`` values (the draws and the bootstrap) and other
``sample_seed`` values (which half of the sequences estimates the null), and counts the (layer, target) rows whose
verdict changes, each question's apart. Prints the time of summary() cold (the verdict computed) and warm (cached).
``--fixed``: every layer on verdict_draws draws, as before a layer whose call hangs on the draws was scored again on
``verdict.EXTEND`` times as many (the comparison that says what the extension buys).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

import eigenhooks as eh
from eigenhooks.monitor import verdict
from eigenhooks.run import load_texts, make_batches


def table(mon, **change):
    """The summary with the config changed (the kept tokens as they are), and its time."""
    mon.config = dataclasses.replace(mon.config, **change)
    mon._acc.sample_version += 1  # the verdict's cache: computed again
    mon._acc.sample_seed = mon.config.sample_seed
    t0 = time.perf_counter()
    df = mon.summary()
    return df, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--fixed", action="store_true", help="no extension: verdict_draws draws on every layer")
    args = ap.parse_args()
    if args.fixed:
        verdict.UNSURE = 0.0  # no call counts as hanging on the draws: none is scored again
    model, tok = eh.load_model(args.model)
    with eh.monitor(model) as mon, torch.no_grad():
        for ids in make_batches(tok, load_texts(), args.max_tokens, 128, 8):
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
    t0 = time.perf_counter()
    base = mon.summary()
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    mon.summary()
    warm = time.perf_counter() - t0
    n = base.drop_duplicates(["layer", "p_tilt", "tilt"])
    print(f"{args.model}: {int(base['n_tokens'].iloc[0])} tokens, {int(base['verdict_sequences'].iloc[0])} scoring "
          f"sequences, {int(base['verdict_tokens'].iloc[0])} scoring tokens a layer, {len(n)} hypotheses")  # fmt: skip
    print(f"summary(): {cold:.1f} s cold (the verdict computed), {warm:.2f} s warm (cached)")
    print("verdicts (null_seed 0, sample_seed 0):", base["verdict"].value_counts().to_dict())
    print("static verdicts:", base["verdict_static"].value_counts().to_dict())
    for what in ("null_seed", "sample_seed"):
        for s in args.seeds[1:]:
            df, secs = table(mon, **{what: s, **({"null_seed": 0} if what == "sample_seed" else {})})
            moved = {c: sorted(set(df.loc[df[c] != base[c], "layer"].tolist())) for c in ("verdict", "verdict_static")}
            more = sorted(set(df.loc[df["verdict_draws"] > df["verdict_draws"].min(), "layer"].tolist()))
            print(f"{what}={s}: layers whose verdict moves {moved['verdict']}, verdict_static {moved['verdict_static']}"
                  f" ({secs:.1f} s; layers on more draws: {more})")  # fmt: skip
        table(mon, null_seed=0, sample_seed=0)


if __name__ == "__main__":
    main()
