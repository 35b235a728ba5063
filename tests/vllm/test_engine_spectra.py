"""``eh.spectra`` on a running ``vllm.LLM`` equals ``eh.spectra`` of the same checkpoint in transformers."""

from __future__ import annotations

import pytest
import torch
from tier import greedy

import eigenhooks as eh
from eigenhooks.models.engines import EngineVerifyError


def _hf(folder):
    import transformers as T

    return T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("variant", ["ov", "ov_ln"])
def test_engine_spectra_equal_transformers(llm_eager, tiny_llama, variant):
    out = llm_eager.generate(["hello world"], greedy(4))  # the engine serves this checkpoint
    assert len(out[0].outputs[0].token_ids) == 4
    got = eh.spectra(llm_eager, variant, cache=False)
    want = eh.spectra(_hf(tiny_llama), variant, cache=False)
    assert [s.layer for s in got] == [0, 1]
    for g, w in zip(got, want):
        ev = [
            sorted(s.eigenvalues.tolist(), key=lambda z: (round(abs(z), 9), round(z.real, 9), z.imag)) for s in (g, w)
        ]
        a, b = torch.tensor(ev[0]), torch.tensor(ev[1])
        assert float((a - b).abs().max() / b.abs().max()) < 1e-6
        assert g.kind == w.kind and g.k == w.k


def test_engine_verify_says_what_to_run_instead(llm_eager, tiny_llama):
    with pytest.raises(EngineVerifyError, match=rf"cannot probe a vllm.LLM.*from_pretrained\('{tiny_llama}'"):
        eh.verify(llm_eager)
    rows = eh.verify(_hf(tiny_llama))  # the check the message names runs, and passes
    assert all(r.rel_diff < 1e-5 for r in rows)
