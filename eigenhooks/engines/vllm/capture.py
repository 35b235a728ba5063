"""The readings inside a vLLM model, placed before vLLM compiles it: graph ops and one opaque op.

vLLM compiles its model at the first forward (``fullgraph=True``, guards skipped), so hooks added later
never run, and Python run per reading would be traced away. The taps here are module hooks registered
right after the model is loaded, before that first forward: dynamo traces them into the graph. Each
hands the pair it sees (``hidden``, ``residual``: the reading is their sum, models/vllm.py) to
``eigenhooks::vllm_tap``, a ``torch.library`` custom op that the compiler keeps opaque (it declares a
write to a one-element token, so it is never dropped): at run time, while a monitor is entered, it
writes ``hidden + residual`` straight into a buffer kept across forwards (grown to the largest forward
measured); otherwise it returns at once, having computed nothing. The sum is written when the op runs,
so an in-place fused add after it (vLLM's CPU ``fused_add_rms_norm`` overwrites its inputs) cannot
change what was read. In eager mode (nothing traced) an idle tap does not even call the op.

``plugin.TAPS`` names this layout; the opt-in puts it in the engine's config hash, so a graph compiled
with another version's taps is never taken from vLLM's compile cache.

Slots: ``2 i`` the pre of layer i, ``2 i + 1`` its attention output, ``2 L`` the last layer's post.
"""

from __future__ import annotations

import torch

from ...models.vllm import vllm_layout


class TapStore:
    """The buffers the taps write into, in this process, and what the last forward wrote.

    ``active``: copy readings (a monitor is entered: ``attach``/``detach`` count them, nested monitors
    sharing the taps). Off, the op returns at once; a CUDA graph being
    captured always copies (the capture is replayed whatever the flag says later).

    Under CUDA graphs (a GPU engine's default; not run here: no device with vLLM was lent) a replay
    writes into the buffer its capture wrote, but runs none of this Python: ``rows`` is not set, so
    ``readings`` gives None and the forward is reported as not measured (``MeasurementWarning``), never
    read from a stale buffer. A buffer a capture wrote into is never freed (``pinned``), so a replay
    never writes into memory handed to something else.
    """

    def __init__(self):
        self.bufs: dict[int, torch.Tensor] = {}
        self.rows: dict[int, int] = {}  # slot -> tokens the last write wrote
        self.active = False
        self.users = 0  # sessions attached
        self.capacity = 0  # the engine's max_num_batched_tokens (the most rows a buffer can need)
        self.n_slots = 0
        self.captured: set[int] = set()  # ids of the buffers a CUDA graph capture wrote into
        self.pinned: list[torch.Tensor] = []  # such buffers, replaced by bigger ones but kept alive

    def write(self, slot: int, x: torch.Tensor, r: torch.Tensor | None = None, scale: float = 1.0) -> None:
        """Write the reading ``x + r`` (``x`` when r is None; ``scale * x`` when scale is not 1, r None) into
        buffer ``slot``, if copying."""
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if not self.active and not capturing:
            return
        n = x.shape[0]
        buf = self.bufs.get(slot)
        if buf is None or buf.shape[0] < n or buf.shape[1:] != x.shape[1:] or buf.dtype != x.dtype:
            if buf is not None and id(buf) in self.captured:
                self.pinned.append(buf)  # a graph's replays write here: never freed
            buf = self.bufs[slot] = x.new_empty((n, *x.shape[1:]))  # grows to the largest forward measured
        if capturing:
            self.captured.add(id(buf))
        if r is None and scale == 1.0:
            buf[:n].copy_(x)
        elif r is None:
            torch.mul(x, scale, out=buf[:n])
        else:
            torch.add(x, r, out=buf[:n])
        self.rows[slot] = n

    def attach(self) -> None:
        self.users += 1
        self.active = True

    def detach(self) -> None:
        self.users = max(self.users - 1, 0)
        self.active = self.users > 0

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


_LIB = torch.library.Library("eigenhooks", "FRAGMENT")  # defined here, not by ``torch.library.custom_op``:
# its Python wrapper costs ~50 us a call against ~13 us for a plain kernel (measured), 61 calls a forward
_LIB.define("vllm_tap(Tensor(a!) token, Tensor x, Tensor? r, SymInt slot, float scale=1.0) -> ()")


def vllm_tap(token: torch.Tensor, x: torch.Tensor, r: torch.Tensor | None, slot: int, scale: float = 1.0) -> None:
    """Write reading ``x + r`` (``x``, or ``scale * x``, when r is None) (tokens, hidden) into buffer ``slot``
    (``TapStore.write``)."""
    STORE.write(slot, x, r, scale)


_LIB.impl("vllm_tap", vllm_tap, "CompositeExplicitAutograd")


@torch.library.register_fake("eigenhooks::vllm_tap", lib=_LIB)
def _(token, x, r, slot, scale=1.0):
    return None


def _tap(x: torch.Tensor, r: torch.Tensor | None, slot: int, scale: float = 1.0) -> None:
    """A reading: the op when traced (it is then in the graph, and runs whenever the graph does); in eager
    mode the write itself, with no dispatch (an idle tap then costs its hook call and one check)."""
    if torch.compiler.is_compiling():
        torch.ops.eigenhooks.vllm_tap(_TOKEN, x, r, slot, scale)
    else:
        STORE.write(slot, x, r, scale)


def _pair(args, kwargs):
    """(hidden, residual) of a decoder layer's call ``layer(positions, hidden, residual)``."""
    h = args[1] if len(args) > 1 else kwargs["hidden_states"]
    r = args[2] if len(args) > 2 else kwargs.get("residual")
    return h, r


def _pre_hook(slot: int):
    def hook(module, args, kwargs):
        _tap(*_pair(args, kwargs), slot)

    return hook


def _out_hook(slot: int, scale: float):
    def hook(module, args, output):
        _tap(output, None, slot, scale)

    return hook


def _post_hook(slot: int, pair: bool):
    def hook(module, args, output):
        if pair:
            _tap(*output, slot)
        else:
            _tap(output, None, slot)

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
        for i, (blk, attn, scale) in enumerate(zip(layout.layers, layout.attention, layout.scales)):
            handles.append(blk.register_forward_pre_hook(_pre_hook(2 * i), with_kwargs=True))
            handles.append(attn.register_forward_hook(_out_hook(2 * i + 1, scale)))
        handles.append(layout.layers[-1].register_forward_hook(_post_hook(2 * L, layout.pair)))
    except BaseException:
        for h in handles:
            h.remove()
        raise
    STORE.capacity, STORE.n_slots = capacity, 2 * L + 1
    return L


__all__ = ["STORE", "TapStore", "place_taps", "vllm_tap"]
