"""Monitor states on fixed reference configurations, saved and compared: "states stay equal".

``python benchmarks/reference_states.py save FILE`` runs the monitor on seven configurations of the
bundled models (gpt2-tiny: one sequence at the default stride and at stride 1, a custom target,
a right-padded batch at stride 1 and at the default stride, ``generate`` from a left-padded
batch; albert-tiny: one sequence) and writes their ``state_dict()`` to FILE.
``python benchmarks/reference_states.py compare OLD NEW`` prints, per configuration, the largest
relative difference of every field and the fields over 1e-6. Save with one version of the code,
save again with another, compare.
"""

import json
import math
import sys
import warnings


def save(out: str) -> None:
    import torch

    import eigenhooks as eh

    warnings.simplefilter("ignore")
    g, gt = eh.zoo.load("gpt2-tiny")
    a, at = eh.zoo.load("albert-tiny")
    texts = [
        "def f(x):\n    return x + 1",
        "The for statement iterates over a sequence.",
        "import os, sys\nprint(sys.argv)",
        "a = [i * i for i in range(10)]",
    ]
    gt.pad_token = gt.pad_token or gt.eos_token
    cfgs = {}

    def run(name, model, calls, **kw):
        with eh.monitor(model, **kw) as mon, torch.no_grad():
            for c in calls:
                c()
        state = mon.state_dict()
        cfgs[name] = {"layers": state["layers"]}

    one = gt([texts[0]], return_tensors="pt")
    u = torch.nn.functional.normalize(torch.randn(128, generator=torch.Generator().manual_seed(0)), dim=0)
    run("gpt2_one", g, [lambda: g(**one)])
    run("gpt2_one_s1", g, [lambda: g(**one)], null_stride=1)
    run("gpt2_one_custom", g, [lambda: g(**one)], targets=[("ov", "modulus"), ("u", u)])
    gt.padding_side = "right"
    rb = gt(texts, return_tensors="pt", padding=True)
    run("gpt2_batch_right_s1", g, [lambda: g(**rb)], null_stride=1)
    run("gpt2_batch_right", g, [lambda: g(**rb)])
    gt.padding_side = "left"
    lb = gt(texts[:2], return_tensors="pt", padding=True)
    run("gpt2_gen", g, [lambda: g.generate(**lb, max_new_tokens=12, do_sample=False, pad_token_id=gt.eos_token_id)])
    ao = at([texts[1]], return_tensors="pt")
    run("albert_one", a, [lambda: a(**ao)])
    with open(out, "w") as fh:
        json.dump(cfgs, fh)
    print("wrote", out, list(cfgs))


def _flat(x):
    if isinstance(x, list):
        for y in x:
            yield from _flat(y)
    else:
        yield x


def _rel(x: float, y: float) -> float:
    if x == y or (math.isnan(x) and math.isnan(y)):
        return 0.0
    return abs(x - y) / max(1.0, abs(x))


def compare(old: str, new: str) -> None:
    from eigenhooks.monitor.stats import TGT_FIELDS

    a, b = json.load(open(old)), json.load(open(new))
    F = len(TGT_FIELDS)
    for cfg in a:
        worst: dict[str, float] = {}
        for layer, fields in a[cfg]["layers"].items():
            for k, v in fields.items():
                xs, ys = list(_flat(v)), list(_flat(b[cfg]["layers"][layer][k]))
                for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
                    name = TGT_FIELDS[i % F] if k == "tgt" else k
                    worst[name] = max(worst.get(name, 0.0), _rel(x, y))
        over = {k: f"{v:.1e}" for k, v in worst.items() if v > 1e-6}
        print(f"{cfg:22s} max rel diff {max(worst.values()):.1e}; over 1e-6: {over or 'none'}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "save":
        save(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
