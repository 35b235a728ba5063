"""The readings inside a vLLM model, placed before vLLM compiles it: graph ops and one opaque op.

vLLM compiles its model at the first forward (``fullgraph=True``, guards skipped), so hooks added later
never run, and Python run per reading would be traced away. The taps here are module hooks registered
right after the model is loaded, before that first forward: dynamo traces them into the graph. Each
computes its reading with graph ops (``hidden + residual``, models/vllm.py) and hands it to
``eigenhooks::vllm_tap``, a ``torch.library`` custom op that the compiler keeps opaque (it declares a
write to a one-element token, so it is never dropped): at run time it copies the reading into a
buffer kept across forwards (grown to the largest forward measured). A copy, made when the op runs, so an in-place fused add after it (vLLM's CPU
``fused_add_rms_norm`` overwrites its inputs) cannot change what was read.

Slots: ``2 i`` the pre of layer i, ``2 i + 1`` its attention output, ``2 L`` the last layer's post.
"""

from __future__ import annotations

import torch

from ...models.vllm import vllm_layout


class TapStore:
    """The buffers the taps write into, in this process, and what the last forward wrote.

    ``active``: copy readings (a monitor is entered). Off, the op returns at once; a CUDA graph being
    captured always copies (the capture is replayed whatever the flag says later).
    """

    def __init__(self):
        self.bufs: dict[int, torch.Tensor] = {}
        self.rows: dict[int, int] = {}  # slot -> tokens the last write wrote
        self.active = False
        self.capacity = 0  # the engine's max_num_batched_tokens (the most rows a buffer can need)
        self.n_slots = 0

    def write(self, slot: int, x: torch.Tensor) -> None:
        if not self.active and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            return
        n = x.shape[0]
        buf = self.bufs.get(slot)
        if buf is None or buf.shape[0] < n or buf.shape[1:] != x.shape[1:] or buf.dtype != x.dtype:
            buf = self.bufs[slot] = x.new_empty((n, *x.shape[1:]))  # grows to the largest forward measured
        buf[:n].copy_(x)
        self.rows[slot] = n

    def start_forward(self) -> None:
        self.rows.clear()

    def readings(self, n_layers: int, tokens: int) -> dict[str, list[torch.Tensor]] | None:
        """The last forward's first ``tokens`` rows of every slot, as views ({point: [layer tensors]}), or
        None if a slot was not written with at least that many rows (a forward the taps did not see)."""
        if any(self.rows.get(s, -1) < tokens for s in range(2 * n_layers + 1)):
            return None
        b = self.bufs
        pre = [b[2 * i][:tokens] for i in range(n_layers)]
        attn = [b[2 * i + 1][:tokens] for i in range(n_layers)]
        post = pre[1:] + [b[2 * n_layers][:tokens]]
        return {"pre": pre, "attn": attn, "post": post}


STORE = TapStore()
_TOKEN = torch.zeros(1)  # what the op declares it writes: an op with no output and no write would be dropped


@torch.library.custom_op("eigenhooks::vllm_tap", mutates_args=("token",))
def vllm_tap(token: torch.Tensor, x: torch.Tensor, slot: int) -> None:
    """Copy reading ``x`` (tokens, hidden) into buffer ``slot`` (``TapStore.write``)."""
    STORE.write(slot, x)


@vllm_tap.register_fake
def _(token, x, slot):
    return None


def _pair(args, kwargs):
    """(hidden, residual) of a decoder layer's call ``layer(positions, hidden, residual)``."""
    h = args[1] if len(args) > 1 else kwargs["hidden_states"]
    r = args[2] if len(args) > 2 else kwargs.get("residual")
    return h, r


def _pre_hook(slot: int):
    def hook(module, args, kwargs):
        h, r = _pair(args, kwargs)
        torch.ops.eigenhooks.vllm_tap(_TOKEN, h if r is None else h + r, slot)

    return hook


def _out_hook(slot: int):
    def hook(module, args, output):
        torch.ops.eigenhooks.vllm_tap(_TOKEN, output, slot)

    return hook


def _post_hook(slot: int):
    def hook(module, args, output):
        h, r = output
        torch.ops.eigenhooks.vllm_tap(_TOKEN, h + r, slot)

    return hook


def place_taps(model, capacity: int) -> int:
    """Register the taps on a freshly loaded vLLM model (before its first forward). Returns its layer count.

    Raises:
        UnsupportedModelError: the model's layers are not laid out as models/vllm.py knows.
    """
    layout = vllm_layout(model)
    L = len(layout.layers)
    handles = []
    try:
        for i, (blk, attn) in enumerate(zip(layout.layers, layout.attention)):
            handles.append(blk.register_forward_pre_hook(_pre_hook(2 * i), with_kwargs=True))
            handles.append(attn.register_forward_hook(_out_hook(2 * i + 1)))
        handles.append(layout.layers[-1].register_forward_hook(_post_hook(2 * L)))
    except BaseException:
        for h in handles:
            h.remove()
        raise
    STORE.capacity, STORE.n_slots = capacity, 2 * L + 1
    return L


__all__ = ["STORE", "TapStore", "place_taps", "vllm_tap"]
