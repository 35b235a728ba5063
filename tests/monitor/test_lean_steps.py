"""A one-token decoding step keeps its readings as they come (``Forward._settle``: one ``forward.Step`` whose
order the steps read alike share) and the flush lays them out once: the same sums, bit for bit, as the steps
read layer by layer (the general path, each layer's readings kept by ``Forward._keep``), which is kept for
every step that is not whole (a layer missing, a module called twice, another thread)."""

import pytest
import torch

import eigenhooks as eh
from eigenhooks.monitor import accumulate, forward, record


def _exactly_equal(a: dict, b: dict) -> None:
    """Every field of every layer's state, bit for bit (NaN where NaN)."""
    assert a.keys() == b.keys()
    for layer in a:
        assert a[layer].keys() == b[layer].keys()
        for k in a[layer]:
            x, y = torch.tensor(a[layer][k], dtype=torch.float64), torch.tensor(b[layer][k], dtype=torch.float64)
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True, msg=f"layer {layer} field {k}")


def _run(model, ids, mask, monkeypatch, lean: bool):
    fast = []
    project_steps = accumulate.project_steps

    def spy(steps, bases, stacks):  # a flush of steps kept as they came: one order object
        fast.append(all([s.order is steps[0].order for s in steps]))
        return project_steps(steps, bases, stacks)

    kw = dict(targets=[("ov", "modulus"), ("ov", "residual")], null_draws=8, fnull_draws=4, eig_top=3, null_stride=3)
    with monkeypatch.context() as mp:
        mp.setattr(accumulate, "project_steps", spy)
        if not lean:
            mp.setattr(record, "lean_layout", lambda *a: False)
        with eh.monitor(model, **kw) as mon, torch.no_grad():  # 12 rows x 24 steps: past the 256-token buffer
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=25, min_new_tokens=25,
                           do_sample=False, pad_token_id=0)  # fmt: skip
    return mon.state_dict()["layers"], mon.summary(), fast


@pytest.mark.parametrize("family", ["llama", "gpt2", "gptj"])
def test_lean_steps_sum_as_the_steps_read_layer_by_layer_bit_for_bit(tiny, family, monkeypatch):
    """gptj is a parallel block: its mid (pre + the attention's output) is summed once over the flush's
    steps instead of once a step, elementwise, so equal too."""
    model = tiny(family)
    ids = torch.randint(3, 60, (12, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # a left-padded row
    lean, s_lean, fast = _run(model, ids, mask, monkeypatch, True)
    plain, s_plain, slow = _run(model, ids, mask, monkeypatch, False)
    assert len(fast) >= 2 and all(fast), f"the lean flush was not taken: {fast}"
    assert not any(slow) and len(slow) == len(fast)
    _exactly_equal(lean, plain)
    assert s_lean["n_tokens"].tolist() == s_plain["n_tokens"].tolist() == [12 * 30 - 2] * len(s_lean)


def test_a_step_that_reads_a_module_twice_takes_the_general_path(tiny, monkeypatch):
    """A tapped module called twice in a step (another tool re-running a norm): the first reading counts,
    as on the general path, and the step is not kept whole."""
    model = tiny("llama")
    ids = torch.randint(3, 60, (2, 5), generator=torch.Generator().manual_seed(2))
    norm = model.model.layers[0].post_attention_layernorm

    def again(module, args, output):  # another tool runs the tapped mid norm once more, on another input
        norm(args[0] * 2)

    kept = []
    settle = forward.Forward._settle

    def spy(self):
        settle(self)
        kept.append(self.lean_step is not None)

    def run(lean):
        with monkeypatch.context() as mp:
            mp.setattr(forward.Forward, "_settle", spy)
            if not lean:
                mp.setattr(record, "lean_layout", lambda *a: False)
            with eh.monitor(model, targets=[("ov", "modulus")], null_draws=4) as mon, torch.no_grad():
                h = model.model.layers[0].input_layernorm.register_forward_hook(again)
                try:
                    model.generate(input_ids=ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
                finally:
                    h.remove()
        return mon.state_dict()["layers"]

    _exactly_equal(run(True), run(False))
    assert len(kept) == 3 and not any(kept), kept  # 3 steps came lean, none was kept whole
