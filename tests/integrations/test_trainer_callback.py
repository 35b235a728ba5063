"""The HF Trainer callback: a real Trainer run, its TensorBoard file read back; the spectra memo after optimizer steps."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import eigenhooks as eh
from eigenhooks.spectra import clear_memo

PROBE = ["def f(x):\n    return x + 1", "class A:\n    pass", "for i in range(10): print(i)"]
TRAIN = [
    "import os\nprint(os.getcwd())",
    "x = [i * i for i in range(5)]",
    "def g(a, b):\n    return a - b",
    "while True:\n    break",
    "print('hello world')",
    "y = {'a': 1, 'b': 2}",
    "class B(A):\n    x = 1",
    "assert 1 + 1 == 2",
]
METRICS = ("gamma_pre", "gamma_mid", "gamma_post", "rho", "n_tokens")


def test_import_eigenhooks_leaves_the_trainer_alone_until_asked():
    code = (
        "import sys, eigenhooks as eh\n"
        "print('transformers.trainer_callback' in sys.modules, 'eigenhooks.integrations' in sys.modules)\n"
        "print(eh.integrations.AlignmentCallback.__name__, 'transformers.trainer_callback' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False", "AlignmentCallback", "True"], out


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
        lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
        lambda p: torch.optim.SGD(p, lr=1e-1, foreach=False),
    ],
    ids=["adamw-foreach", "adamw-fused", "sgd-for-loop"],
)
def test_the_spectra_memo_sees_optimizer_steps(make):
    model, tok = eh.zoo.load("gpt2-tiny")
    before = eh.spectra(model)
    opt = make(model.parameters())
    batch = tok(PROBE[:1], return_tensors="pt")
    model(**batch, labels=batch["input_ids"]).loss.backward()
    opt.step()
    after = eh.spectra(model)  # from the memo if it (wrongly) kept the old weights' entries
    fresh = eh.spectra(model, cache=False)
    for b, a, f in zip(before, after, fresh):
        assert abs(a.lambda_1 - b.lambda_1) > 1e-6, f"layer {a.layer}: the step did not change lambda_1"
        assert a.lambda_1 == f.lambda_1 and torch.equal(a.basis, f.basis), f"layer {a.layer}: a stale spectrum"


def _trainer(model, tok, out, lr, max_steps, eval_dataset=None, **kw):
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(out),
        max_steps=max_steps,
        per_device_train_batch_size=2,
        learning_rate=lr,
        logging_steps=1,
        report_to=["tensorboard"],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        **kw,
    )
    train = [{"input_ids": tok(t)["input_ids"]} for t in TRAIN]
    collator = DataCollatorForLanguageModeling(tok, mlm=False)
    return Trainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=eval_dataset,
        data_collator=collator,
        processing_class=tok,
    )


def test_a_real_trainer_run_logs_alignment_where_report_to_sends_it(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    model, tok = eh.zoo.load("gpt2-tiny")
    trainer = _trainer(model, tok, tmp_path / "out", lr=5e-3, max_steps=6)
    cb = eh.integrations.AlignmentCallback(PROBE, every_n_steps=2).attach(trainer)
    trainer.train()
    assert [s for s, _ in cb.history] == [2, 4, 6]

    ea = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    ea.Reload()
    tags = {t for t in ea.Tags()["scalars"] if t.startswith("train/eigenhooks/")}
    assert len(tags) == model.config.n_layer * 2 * len(METRICS), sorted(tags)[:5]
    assert [e.step for e in ea.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6], "the Trainer's own logging was cut"
    written = {t: {e.step: e.value for e in ea.Scalars(t)} for t in tags}
    for t, by_step in written.items():
        assert sorted(by_step) == [2, 4, 6], t

    # What was written at step 6 is the probe measured on the weights training ended with: a fresh
    # monitor (the memo cleared, so nothing of the callback's runs is reused) must agree.
    clear_memo()
    batch = tok(PROBE, return_tensors="pt", padding=True)
    model.eval()
    with eh.monitor(model) as mon, torch.no_grad():
        model(**batch)
    for r in mon.summary().itertuples():
        for m in METRICS:
            t = f"train/eigenhooks/{m}/L{r.layer:02d}/{r.target.replace('/', '-')}"
            assert written[t][6] == pytest.approx(getattr(r, m), rel=1e-5, abs=1e-6), (t, written[t][6], getattr(r, m))

    # and the values follow the weights as they change
    gammas = [t for t in tags if "/gamma_" in t]
    moved = [t for t in gammas if abs(written[t][6] - written[t][2]) > 1e-4]
    assert len(moved) >= len(gammas) // 2, f"only {len(moved)} of {len(gammas)} gammas moved between steps 2 and 6"


def test_evaluation_measures_once_per_step(tmp_path, monkeypatch):
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    model, tok = eh.zoo.load("gpt2-tiny")
    evals = [{"input_ids": tok(t)["input_ids"]} for t in PROBE]
    trainer = _trainer(model, tok, tmp_path / "out", 1e-3, 4, evals, eval_strategy="steps", eval_steps=2)
    cb = eh.integrations.AlignmentCallback(
        {
            "input_ids": torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]]),
            "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]),
        },
        every_n_steps=2,
    ).attach(trainer)
    trainer.train()
    assert [s for s, _ in cb.history] == [2, 4]  # on_step_end and on_evaluate at the same step: one measurement
    assert all(v["eigenhooks/n_tokens/L00/ov-modulus"] == 6 for _, v in cb.history)  # padding left out
    logged = [h for h in trainer.state.log_history if "eigenhooks/rho/L00/ov-modulus" in h]
    assert [h["step"] for h in logged] == [2, 4]


def test_without_attach_it_says_how(tmp_path, monkeypatch):
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    model, tok = eh.zoo.load("gpt2-tiny")
    trainer = _trainer(model, tok, tmp_path / "out", lr=1e-3, max_steps=1)
    trainer.add_callback(eh.integrations.AlignmentCallback(PROBE, every_n_steps=1))
    with pytest.raises(RuntimeError, match=r"\.attach\(trainer\)"):
        trainer.train()


def test_bad_arguments():
    with pytest.raises(ValueError, match="every_n_steps must be a positive int"):
        eh.integrations.AlignmentCallback(PROBE, every_n_steps=0)
    with pytest.raises(ValueError, match="the probe set is empty"):
        eh.integrations.AlignmentCallback([])
    model, _ = eh.zoo.load("gpt2-tiny")
    with pytest.raises(ValueError, match="no processing_class to tokenize it"):
        eh.integrations.AlignmentCallback(PROBE).measure(model, None)
    with pytest.raises(TypeError, match="a probe row must be a text or a mapping"):
        eh.integrations.AlignmentCallback([3.5]).measure(model, None)
