"""Is steering's calibration unchanged by its cheaper sample? The old sampler against the new, over seeds.

Signed steering reads its read-out b from the mean head output at the steered layer over calibration
text, by default text the model samples itself. Until 2026-12-06 that was 4 sequences of 32 tokens,
sampled with a full forward over the whole prefix at every step (``old_sample_tokens`` below: the code
of ``git show 947d7e6^:eigenhooks/steer/edit.py``, kept here as the reference, not in the package);
now it is ``calibration.N_CALIBRATION`` sequences, KV-cached. For each seed, both samples calibrate
``eh.steer(model, u, layer=...)`` at its default strength (gap ratio 0.1), and this prints the
strength alpha and lambda of each, then issue 40's bar: lambda and b of the same sign on every seed,
and |mean alpha_new - mean alpha_old| / SE <= 3, SE the standard error of the old alphas over the seeds.
That bar is weak on SmolLM2 (128 random tokens, no sampling, pass it at the last layer), so it also
prints a stricter one: the angle between the seeds' mean calibration directions z̄ / ||z̄||, new against
old, in standard errors of the old one (random tokens are 5 SE away there).

``--control`` also scores the old sampler against itself on the next seeds (5..9 for 5 seeds): how
often the 3-SE bar fails for no change at all, the noise floor to read the other rows against.
``--push`` also prints what each sample's read-out writes into the typical token (mean ||a|| |bᵀz|
over the unrelated prompts of ``steer_vs_actadd.py``, alpha 0.3): not the issue's bar, but where
the shorter sample shows (about 8% more than the old one's, far outside its SE).

Usage: python benchmarks/steer_calibration_check.py [--words " Paris"] [--layers -1] [--seeds 5]
       [--threads 1] [--control] [--push]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import warnings

import torch

OLD_SHAPE = (4, 32)


@torch.no_grad()
def old_sample_tokens(model, seed: int, shape=OLD_SHAPE) -> torch.Tensor:
    """The calibration sample before 2026-12-06: a seeded random first token, then temperature-1 samples,
    each from a full forward over the whole prefix (no KV cache). (batch, seq) token ids."""
    g = torch.Generator().manual_seed(seed)
    dev = next(model.parameters()).device
    ids = torch.randint(0, model.get_input_embeddings().num_embeddings, (shape[0], 1), generator=g)
    for _ in range(shape[1] - 1):
        logits = model(ids.to(dev)).logits[:, -1].to("cpu", torch.float64)
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)  # (batch, 1)
        ids = torch.cat([ids, nxt], 1)
    return ids


def calibrated(model, u, layer: int, ids: torch.Tensor) -> tuple[float, float, torch.Tensor]:
    """(alpha, lambda, b) of the default steering (exact, signed, gap ratio 0.1) calibrated on ids."""
    import eigenhooks as eh

    s = eh.steer(model, u, layer=layer, calibration=ids)
    return s.alpha, s.change.lam, s.change.b


def verdict(old: list, new: list) -> dict:
    """Issue 40's bar for two lists of (alpha, lambda, b), seed by seed."""
    ao, an = [o[0] for o in old], [n[0] for n in new]
    same_sign = all(
        math.copysign(1, o[1]) == math.copysign(1, n[1]) and float(o[2] @ n[2]) > 0 for o, n in zip(old, new)
    )
    se = statistics.stdev(ao) / math.sqrt(len(ao))
    diff = abs(statistics.mean(an) - statistics.mean(ao))
    return {
        "old": statistics.mean(ao),
        "new": statistics.mean(an),
        "se": se,
        "ratio": diff / se,
        "same_sign": same_sign,
    }


def samples(model, seeds, control: bool = False) -> dict:
    """{'old': [ids per seed], 'new': [...], and 'control': the old sampler on the next seeds}."""
    from eigenhooks.steer import calibration as C

    out = {
        "old": [old_sample_tokens(model, s) for s in seeds],
        "new": [C.sample_tokens(model, C.N_CALIBRATION, seed=s, progress=False) for s in seeds],
    }
    if control:
        out["control"] = [old_sample_tokens(model, s + len(seeds)) for s in seeds]
    return out


def mean_direction(model, layer: int, ids: torch.Tensor) -> torch.Tensor:
    """z̄ / ||z̄||: the unit mean head output entering layer's output projection over ids, what b is read from."""
    import eigenhooks as eh
    from eigenhooks.steer.calibration import value_activations

    ad = eh.get_adapter(model)
    z = value_activations(ad, ad.layers[layer].o_proj, ids).mean(0)
    return z / torch.linalg.vector_norm(z)


def _angle(a: torch.Tensor, b: torch.Tensor) -> float:
    return math.degrees(math.acos(max(-1.0, min(1.0, float(a @ b)))))


def direction_verdict(old: list, new: list) -> dict:
    """A stricter bar than alpha's: the angle between the seeds' mean z̄ directions, new against old, in
    standard errors of the old mean direction (the rms angle of the old seeds to their mean / sqrt(n - 1))."""
    mo, mn = torch.stack(old).mean(0), torch.stack(new).mean(0)
    mo, mn = mo / torch.linalg.vector_norm(mo), mn / torch.linalg.vector_norm(mn)
    se = math.sqrt(sum(_angle(e, mo) ** 2 for e in old) / len(old)) / math.sqrt(len(old) - 1)
    return {"angle": _angle(mn, mo), "angle_se": se, "angle_ratio": _angle(mn, mo) / se}


def push_size(model, tok, u, ids: torch.Tensor, texts: list[str]) -> float:
    """What the read-out calibrated on ids writes into the typical token: mean ||a|| |bᵀz| over the
    tokens of texts at the last layer, at alpha 0.3 (the exact construction's floor)."""
    import eigenhooks as eh
    from eigenhooks.steer.calibration import value_activations

    ad = eh.get_adapter(model)
    z = value_activations(ad, ad.layers[-1].o_proj, dict(tok(texts, return_tensors="pt", padding=True)))
    s = eh.steer(model, u, alpha=0.3, calibration=ids)
    return float((z @ s.change.b).abs().mean() * torch.linalg.vector_norm(s.change.a))


def compare(model, u, layer: int = -1, seeds=range(5), ids: dict | None = None) -> dict:
    """The bars for one direction and layer: {'new': {...}[, 'control': {...}]}, each verdict(old, that)
    and direction_verdict(old, that)."""
    ids = samples(model, seeds) if ids is None else ids
    got = {k: [calibrated(model, u, layer, x) for x in v] for k, v in ids.items()}
    dirs = {k: [mean_direction(model, layer, x) for x in v] for k, v in ids.items()}
    return {k: {**verdict(got["old"], got[k]), **direction_verdict(dirs["old"], dirs[k])} for k in got if k != "old"}


def load_smollm2(threads: int):
    """(model, tokenizer) of SmolLM2-135M on ``threads`` threads, warnings silenced."""
    import eigenhooks as eh

    warnings.simplefilter("ignore")
    torch.set_num_threads(threads)
    return eh.zoo.load("smollm2-135m")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--words", nargs="+", default=[" Paris"])
    p.add_argument("--layers", nargs="+", type=int, default=[-1])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--control", action="store_true")
    p.add_argument("--push", action="store_true")
    a = p.parse_args()
    import eigenhooks as eh
    from eigenhooks.steer import calibration as C

    model, tok = load_smollm2(a.threads)
    t = time.perf_counter()
    ids = samples(model, range(a.seeds), a.control)
    print(f"sampled in {time.perf_counter() - t:.0f} s: old {OLD_SHAPE} full forwards, new {C.N_CALIBRATION} KV-cached")
    fails = {}
    for word in a.words:
        u = eh.direction.token(model, tok, word)
        for layer in a.layers:
            for k, v in compare(model, u, layer, range(a.seeds), ids).items():
                ok = v["same_sign"] and v["ratio"] <= 3
                fails[k] = fails.get(k, 0) + (not ok)
                print(
                    f"{word!r:>10} layer {layer:>3} {k:>7}: alpha old {v['old']:.4f} (SE {v['se']:.4f}) "
                    f"{k} {v['new']:.4f}, |diff|/SE {v['ratio']:.2f}, same sign {v['same_sign']}: "
                    f"{'within' if ok else 'OUTSIDE'}; z̄ {v['angle']:.1f} deg from old's, "
                    f"{v['angle_ratio']:.1f} SE",
                    flush=True,
                )
    n = len(a.words) * len(a.layers)
    print("; ".join(f"{k}: {f} of {n} outside the bar" for k, f in fails.items()))
    if a.push:  # not issue 40's bar: what the read-out writes, on the contest's unrelated prompts
        from steer_vs_actadd import UNRELATED

        u = eh.direction.token(model, tok, a.words[0])
        for k, v in ids.items():
            w = [push_size(model, tok, u, x, UNRELATED) for x in v]
            print(
                f"push at alpha 0.3, {a.words[0]!r}, last layer, {k}: {statistics.mean(w):.1f} (SE "
                f"{statistics.stdev(w) / math.sqrt(len(w)):.1f}; seeds {', '.join(f'{x:.1f}' for x in w)})"
            )


if __name__ == "__main__":
    main()
