"""The readings inside a vLLM model, placed before vLLM compiles it: graph ops and one opaque op.

vLLM compiles its model at the first forward (``fullgraph=True``, guards skipped), so hooks added later
never run, and Python run per reading would be traced away. The taps here are module hooks registered
right after the model is loaded, before that first forward: dynamo traces them into the graph. Each
hands the pair it sees (``hidden``, ``residual``: the reading is their sum, models/vllm.py) to
``eigenhooks::vllm_tap``, a ``torch.library`` custom op that the compiler keeps opaque (it declares a
write to a one-element token, so it is never dropped): at run time, while a monitor is entered, it
writes ``hidden + residual`` straight into a buffer allocated once and never moved, and counts the write
on the device (``TapStore``: device writes only, what a CUDA graph's replay repeats); otherwise it
returns at once, having computed nothing. The sum is written when the op runs,
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
    """The buffers the taps write into, in this process, allocated once and never moved, and a count of
    the writes, kept on the device.

    What the op does is device writes only, so that a CUDA graph can replay it (a replay runs none of
    this Python): the reading into row slot of ``slab`` (``fixed`` tokens at most, allocated at the first
    write, zeros) and one added to ``count[slot]``. Which rows hold which requests' tokens, and how many,
    is the host's batch metadata, known after the forward (``readings``); whether the taps wrote the
    forward is ``check``: every slot's count went up by one since the last check, compared on the device
    (no host read a forward; a forward they did not write then counts none of its tokens, and ``missed``
    says how many there were when the state is read). A forward wider than ``fixed`` (a prefill past the
    graphs' largest batch, which no graph replays: this Python runs) is written into ``wide``, a buffer a
    slot grown to the widest forward measured while a monitor is entered, freed when the last one leaves.

    ``active``: write (a monitor is entered: ``attach``/``detach`` count them, nested monitors sharing the
    taps). Off, the op returns at once; a CUDA graph being captured always writes (its replays write
    whatever the flag says later; ``check`` counts from the last attach).
    """

    def __init__(self):
        self.slab: torch.Tensor | None = None  # (slots, fixed, hidden): forwards of up to ``fixed`` tokens
        self.wide: dict[int, torch.Tensor] = {}  # slot -> (tokens, hidden): wider forwards (never replayed)
        self.count: torch.Tensor | None = None  # (slots,) int64 on the device: writes per slot
        self.seen: torch.Tensor | None = None  # ``count`` at the last check
        self.missed: torch.Tensor | None = None  # () int64: checked forwards the taps did not write
        self.active = False
        self.users = 0  # sessions attached
        self.capacity = 0  # the engine's max_num_batched_tokens (the most tokens a forward can have)
        self.fixed = 0  # the slab's tokens: the largest batch a CUDA graph replays (at most ``capacity``)
        self.n_slots = 0

    def reserve(self, hidden: int, dtype: torch.dtype, device) -> None:
        """The slab and the counters, allocated once, before the engine's first forward (a write inside a
        CUDA graph capture must not allocate: the allocation's kernels would be replayed with it)."""
        self.slab = torch.zeros(self.n_slots, self.fixed, hidden, dtype=dtype, device=device)  # a row never
        self.count = torch.zeros(self.n_slots, dtype=torch.int64, device=device)  # written is finite (zeros)
        self.seen = self.count.clone()
        self.missed = torch.zeros((), dtype=torch.int64, device=device)

    def write(self, slot: int, x: torch.Tensor, r: torch.Tensor | None = None, scale: float = 1.0) -> None:
        """Write the reading ``x + r`` (``x`` when r is None; ``scale * x`` when scale is not 1, r None) into
        slot ``slot``, if writing: device writes only (a graph replays them)."""
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if not self.active and not capturing:
            return
        if self.slab is None:
            self.reserve(x.shape[-1], x.dtype, x.device)
        n, slab = x.shape[0], self.slab
        if n <= self.fixed:  # what ``readings`` reads for a forward this narrow, whatever wrote it
            if slab.shape[2:] != x.shape[1:]:
                raise RuntimeError(
                    f"eigenhooks: a reading of shape {tuple(x.shape)} does not fit the taps' slab "
                    f"{tuple(slab.shape)} (reserved for the model's hidden size)"
                )
            buf = slab[slot, :n]
            if slab.dtype != x.dtype:  # computed in the reading's dtype, kept in the slab's
                buf.copy_(x if r is None and scale == 1.0 else x * scale if r is None else x + r)
                self.count[slot : slot + 1].add_(1)
                return
        else:  # wider than any graph replays: grown here, in Python (no graph holds its address)
            buf = self.wide.get(slot)
            if buf is None or buf.shape[0] < n or buf.shape[1:] != x.shape[1:] or buf.dtype != x.dtype:
                buf = self.wide[slot] = x.new_empty((n, *x.shape[1:]))
            buf = buf[:n]
        if r is None and scale == 1.0:
            buf.copy_(x)
        elif r is None:
            torch.mul(x, scale, out=buf)
        else:
            torch.add(x, r, out=buf)
        self.count[slot : slot + 1].add_(1)

    def attach(self) -> None:
        if not self.active and self.count is not None:  # writes while idle (graph replays) do not count
            self.seen.copy_(self.count)
        self.users += 1
        self.active = True

    def detach(self) -> None:
        """One session fewer; after the last, the wide buffers go (sized by the widest forward measured: a
        1,024-token prefill's are 144 MB on SmolLM2, which an idle engine would otherwise keep). The slab
        stays: a CUDA graph holds its address."""
        self.users = max(self.users - 1, 0)
        self.active = self.users > 0
        if not self.active and self.wide:
            self.wide = {}
            from ..checkpoint import trim_heap

            trim_heap()

    def forget(self) -> None:
        """The writes since the last check were of no request's forward (a dummy one: data parallel's idle
        ranks run one whenever another rank has work): not checked, not counted, and the next forward's check
        counts from here (a device copy; nothing read back)."""
        if self.count is not None:
            self.seen.copy_(self.count)

    def check(self) -> torch.Tensor | None:
        """After a forward: whether the taps wrote it, every slot once, as a device bool (nothing read back;
        ``missed`` counts the forwards they did not write). None: nothing was ever written (no slab)."""
        if self.count is None:
            return None
        ok = self.count.sub(self.seen).eq(1).all()
        self.seen.copy_(self.count)
        self.missed.add_(ok.logical_not())
        return ok

    def n_missed(self) -> int:
        """Checked forwards the taps did not write, so far (a host read: when the state is read)."""
        return 0 if self.missed is None else int(self.missed)

    def readings(self, n_layers: int, tokens: int) -> dict[str, list[torch.Tensor]] | None:
        """The last forward's first ``tokens`` rows of every slot, as views ({point: [layer tensors]}): the slab's
        if it fits there, else the wide buffers (None if a wide buffer was not written that wide: a forward
        the taps did not see)."""
        if self.slab is None:
            return None
        if tokens <= self.fixed:
            b = self.slab[:, :tokens]
        elif all(self.wide.get(s) is not None and self.wide[s].shape[0] >= tokens for s in range(2 * n_layers + 1)):
            b = [self.wide[s][:tokens] for s in range(2 * n_layers + 1)]
        else:
            return None
        pre = [b[2 * i] for i in range(n_layers)]
        attn = [b[2 * i + 1] for i in range(n_layers)]
        post = pre[1:] + [b[2 * n_layers]]
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
    mode the write itself, with no dispatch (an idle tap then costs its hook call and one check). Under vLLM's
    transformers backend the layers see the flat batch as one sequence, (1, tokens, hidden): its view as
    (tokens, hidden) is written."""
    if x.dim() == 3:
        x = x[0]
        r = None if r is None else r[0]
    if torch.compiler.is_compiling():
        torch.ops.eigenhooks.vllm_tap(_TOKEN, x, r, slot, scale)
    else:
        STORE.write(slot, x, r, scale)


def _pair(args, kwargs):
    """(hidden, residual) of a decoder layer's call ``layer(positions, hidden, residual)``."""
    h = args[1] if len(args) > 1 else kwargs["hidden_states"]
    r = args[2] if len(args) > 2 else kwargs.get("residual")
    return h, r


def _pre_hook(slot: int, hf: bool = False):
    def hook(module, args, kwargs):
        if hf:  # transformers' layer(hidden_states, ...)
            _tap(args[0] if args else kwargs["hidden_states"], None, slot)
        else:
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
            _tap(output[0] if isinstance(output, tuple) else output, None, slot)

    return hook


def place_taps(
    model, capacity: int, fixed: int = 256, hidden: int = 0, dtype=None, device=None, architecture: str | None = None
) -> int:
    """Register the taps on a freshly loaded vLLM model (before its first forward). Returns its layer count.

    capacity: the most tokens of a forward (max_num_batched_tokens). fixed: the most tokens of a forward a
    CUDA graph replays (its readings go to the slab, ``TapStore``). hidden, dtype, device: the residual
    stream's width, dtype and device: the slab is allocated now (0: at the first write).

    Raises:
        UnsupportedModelError: the model's layers are not laid out as models/vllm.py knows.
    """
    layout = vllm_layout(model, architecture)
    L = len(layout.layers)
    handles = []
    try:
        for i, (blk, attn, scale) in enumerate(zip(layout.layers, layout.attention, layout.scales)):
            handles.append(blk.register_forward_pre_hook(_pre_hook(2 * i, layout.hf), with_kwargs=True))
            handles.append(attn.register_forward_hook(_out_hook(2 * i + 1, scale)))
        handles.append(layout.layers[-1].register_forward_hook(_post_hook(2 * L, layout.pair)))
    except BaseException:
        for h in handles:
            h.remove()
        raise
    STORE.capacity, STORE.fixed, STORE.n_slots = capacity, min(capacity, fixed), 2 * L + 1
    if hidden:
        STORE.reserve(hidden, dtype, device)
    return L


__all__ = ["STORE", "TapStore", "place_taps", "vllm_tap"]
