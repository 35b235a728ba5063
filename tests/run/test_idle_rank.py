"""A torchrun rank that gets no batch says so, and is not told its model was compiled."""

from __future__ import annotations

import warnings

import eigenhooks as eh
from eigenhooks.run import distributed as D
from eigenhooks.run import job
from eigenhooks.run.texts import TokenBatches


def _fed(rank: int, world: int):
    """Run rank ``rank`` of ``world``'s share of a text that makes one batch; its warnings."""
    st = job._Study(None)
    st.model, st.tok = eh.zoo.load("gpt2-tiny")
    st.mon = eh.monitor(st.model)
    batches = TokenBatches(st.tok, iter(["one short text, one batch"]), max_tokens=16, seq_len=16, batch_size=8)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        job._forwards(st, batches, D.Context(rank, world, None), "hf", progress=False)
    return st, [str(w.message) for w in said if issubclass(w.category, eh.MeasurementWarning)]


def test_an_idle_rank_says_it_had_no_batch_and_blames_no_compile():
    st, said = _fed(1, 2)
    assert st.mon.n_forwards == 0
    assert not [m for m in said if "torch.compile" in m], said
    assert said == [
        "rank 1 of 2 got no batch (the text made 1 batch(es) of --batch-size 8) and measured nothing: "
        "give more text, a smaller --batch-size, or fewer ranks"
    ]


def test_the_rank_with_the_batch_warns_nothing():
    st, said = _fed(0, 2)
    assert st.mon.n_forwards == 1 and said == []
