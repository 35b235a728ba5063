"""Where steering's token probabilities are taken, and which tokens it moves which way (issue 58).

On the README's 2-prompt batch (right-padded) the report's "before" was the mean over the batch's last
column, which for the shorter prompt is a pad token: 8.6e-4 there, 6.9e-5 at the prompts' own last tokens.
It is now each sequence's last real token. On a 6 x 128 batch of the bundled text, steering toward " return"
raised the mean at the last positions while lowering it in 5 of the 6 sequences: the rank-1 change pushes
each token along +u or -u by the sign of its read-out b . z (z: the heads' outputs entering O), and the
report now says in how many sequences it rose. Both are checked here against probabilities computed by hand.
"""

from __future__ import annotations

import pytest
import torch

import eigenhooks as eh
from eigenhooks.run.texts import make_batches, sample_text

PROMPTS = ["def f(x):\n    return x", "class A:\n    pass"]  # the README's batch


@pytest.fixture(scope="module")
def gpt2():
    model, tok = eh.zoo.load("gpt2-tiny")
    u = eh.direction.token(model, tok, " return")
    return model, tok, u, eh.direction.token_id(tok, " return")


def _probs(model, batch, t) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).logits.double().softmax(-1)[..., t]  # (batch, seq)


@pytest.mark.parametrize("side", ["right", "left"])
def test_probabilities_are_taken_at_each_sequences_last_real_token(gpt2, side):
    model, tok, u, t = gpt2
    tok.padding_side = side
    try:
        batch = tok(PROMPTS, return_tensors="pt", padding=True)
    finally:
        tok.padding_side = "right"
    mask = batch["attention_mask"].bool()
    assert not mask.all()  # the batch is padded
    last = [int(torch.nonzero(row)[-1]) for row in mask]  # each prompt's last real token
    before = _probs(model, batch, t)
    with eh.steer(model, u, gap_ratio=0.1, progress=False) as s:
        after = _probs(model, batch, t)
    rep = s.summary(target_token=t)
    b = torch.stack([before[i, j] for i, j in enumerate(last)])
    a = torch.stack([after[i, j] for i, j in enumerate(last)])
    assert rep.prob_before == pytest.approx(float(b.mean()), rel=1e-9)
    assert rep.prob_after == pytest.approx(float(a.mean()), rel=1e-9)
    assert (rep.prob_raised, rep.n_sequences) == (int((a > b).sum()), 2)
    if side == "right":  # the batch's last column is a pad for the shorter prompt: not what is reported
        assert abs(rep.prob_before - float(before[:, -1].mean())) > 1e-4
    assert "at each sequence's last real token" in repr(rep) and "of 2)" in repr(rep)


def test_a_token_rises_exactly_where_its_read_out_is_positive(gpt2):
    """The " return" case: on 6 x 128 tokens of the bundled text the mean at the last positions rises while
    most sequences fall, because each token moves along the sign of b . z, not always toward +u."""
    model, tok, u, t = gpt2
    ids = make_batches(tok, [sample_text()], 6 * 128, 128, 6)[0]
    before = _probs(model, {"input_ids": ids}, t)
    z = {}
    with eh.steer(model, u, gap_ratio=0.1, progress=False) as s:
        hook = s.o_proj.register_forward_hook(lambda m, args, out: z.__setitem__("z", args[0].detach()))
        try:
            after = _probs(model, {"input_ids": ids}, t)
        finally:
            hook.remove()
    rep = s.summary(target_token=t)
    read = z["z"].double() @ s.change.b  # (6, 128): each token's read-out
    raised = after > before
    assert torch.equal(raised, read > 0)  # every one of the 768 tokens: up where b . z > 0, down elsewhere
    assert 0.5 < float((read > 0).double().mean()) < 0.9  # signed: most tokens, not all, go toward +u
    assert rep.n_sequences == 6 and rep.prob_raised == int((read[:, -1] > 0).sum()) < 6
