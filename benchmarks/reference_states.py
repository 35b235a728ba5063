"""Monitor states on fixed reference configurations, saved and compared: "states stay equal".

``python benchmarks/reference_states.py save FILE`` runs the monitor on eleven configurations
(gpt2-tiny: one sequence at the default stride and at stride 1, a custom target, a right-padded
batch at stride 1 and at the default stride, ``generate`` from a left-padded batch, ``generate``
past a buffer flush, two merged states; albert-tiny: one sequence; a seeded tiny post-norm BERT; a
seeded tiny GQA Llama) and writes each one's ``state_dict()`` and ``summary()`` to FILE.
``python benchmarks/reference_states.py compare OLD NEW`` prints, per configuration, the largest
relative difference of every state field and the summary's float columns, and the count and
discrete columns that differ at all (they must not). Save with one version of the code, save
again with another, compare. Only the public API is used, so any version can save.
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

    def keep(name, mon):
        df = mon.summary()
        cfgs[name] = {"layers": mon.state_dict()["layers"], "summary": json.loads(df.to_json(orient="records"))}

    def run(name, model, calls, **kw):
        with eh.monitor(model, **kw) as mon, torch.no_grad():
            for c in calls:
                c()
        keep(name, mon)
        return mon

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
    long = gt(texts, return_tensors="pt", padding=True)  # 4 sequences x 70 new tokens: past the 256-token buffer
    gen = dict(max_new_tokens=70, min_new_tokens=70, do_sample=False, pad_token_id=gt.eos_token_id)
    run("gpt2_gen_flush", g, [lambda: g.generate(**long, **gen)])
    m1 = run("gpt2_merge_a", g, [lambda: g(**one)])
    m2 = run("gpt2_merge_b", g, [lambda: g(**lb)])
    merged = eh.monitor(g)
    merged.load_state_dict(m1.state_dict())
    merged.merge_state_dict(m2.state_dict())
    keep("gpt2_merged", merged)
    ao = at([texts[1]], return_tensors="pt")
    run("albert_one", a, [lambda: a(**ao)])
    import transformers as T

    torch.manual_seed(0)
    bert = T.BertModel(T.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                    vocab_size=99, max_position_embeddings=64)).eval()  # fmt: skip
    ids = torch.randint(0, 99, (3, 17), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)
    am[1, 12:] = 0
    run("bert_postnorm", bert, [lambda: bert(input_ids=ids, attention_mask=am)], null_stride=2)
    torch.manual_seed(0)
    cfg = T.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=99, max_position_embeddings=64)  # fmt: skip
    llama = T.LlamaForCausalLM(cfg).eval()
    run("llama_gqa", llama, [lambda: llama(input_ids=ids, attention_mask=am)])
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
    from eigenhooks.monitor.measures import TGT_FIELDS

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
        print(f"{cfg:22s} state: max rel diff {max(worst.values()):.1e}; over 1e-6: {over or 'none'}")
        if "summary" in a[cfg] and "summary" in b[cfg]:
            _compare_summary(cfg, a[cfg]["summary"], b[cfg]["summary"])


DISCRETE = ("n_tokens", "n_nonfinite", "n_sequences", "null_tokens", "p_null", "q_null", "eig_rank", "rho_percentile",
            "gamma_pre_percentile", "gamma_mid_percentile", "fnull_percentile", "verdict", "kind", "k")  # fmt: skip


def _compare_summary(cfg: str, rows_a: list, rows_b: list) -> None:
    """Counts and discrete columns exactly; every other number to 1e-6 relative."""
    worst, moved = 0.0, set()
    assert len(rows_a) == len(rows_b), f"{cfg}: {len(rows_a)} rows vs {len(rows_b)}"
    for ra, rb in zip(rows_a, rows_b):
        for col, x in ra.items():
            y = rb.get(col)
            if col in DISCRETE or isinstance(x, str) or x is None or y is None:
                if x != y:
                    moved.add(col)
            else:
                worst = max(worst, _rel(float(x), float(y)))
    print(f"{'':22s} summary: floats max rel diff {worst:.1e}; discrete columns that differ: {sorted(moved) or 'none'}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "save":
        save(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
