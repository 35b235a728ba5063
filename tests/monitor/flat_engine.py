"""A fake flat-batch engine on a tiny HF model: what a vLLM-like engine hands the monitor (docs/adapters.md).

Its requests are rows of flat, ragged token batches (tokens, d); it says each token's request and
position; a request lasts across its forwards (a chunked prefill, decoding steps) until the engine's
scheduler ends it. Its readings are the model's own: one right-padded forward of every request,
read by the engine's own hooks (in eager mode; or written into buffers by graph ops inside
``torch.compile(fullgraph=True)``, where no Python runs per reading) and handed to the record flat,
as the engine schedules them: a forward's readings all at once after it.
"""

from __future__ import annotations

import dataclasses

import torch
import transformers as T

from eigenhooks.models import Adapter, get_adapter
from eigenhooks.models.attach import Attachment, CallFacts, FlatRows
from eigenhooks.models.hooks import TapLayout

CONFIG = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")  # fmt: skip


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    """A seeded tiny Llama (float64), the same in every process."""
    torch.manual_seed(seed)
    model = T.LlamaForCausalLM(T.LlamaConfig(**CONFIG))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.to(torch.float64).eval()


def padded(seqs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The requests as one right-padded batch (input_ids, attention_mask), in the dict's order."""
    n = max(len(s) for s in seqs.values())
    ids = torch.zeros(len(seqs), n, dtype=torch.long)
    mask = torch.zeros(len(seqs), n, dtype=torch.long)
    for r, s in enumerate(seqs.values()):
        ids[r, : len(s)] = torch.tensor(s)
        mask[r, : len(s)] = 1
    return ids, mask


class FlatEngine:
    """Runs requests on ``model`` and, once attached (``FlatAttachment``), tells the record flat batches.

    compiled: the model runs under ``torch.compile(fullgraph=True)``; its hooks write each reading into
    a buffer (a graph op), and ``python_reads`` counts the hooks that ran as Python outside tracing.
    """

    def __init__(self, model, compiled: bool = False):
        self.model, self.compiled = model, compiled
        self.adapter = FlatAdapter(
            **{f.name: getattr(a, f.name) for a in [get_adapter(model)] for f in dataclasses.fields(a)}
        )
        self.adapter.engine = self
        self.att: FlatAttachment | None = None
        self.readings: dict = {}  # request key -> {(layer, point): (its tokens, d)}
        self.python_reads = 0

    def prefill(self, seqs: dict) -> None:
        """Compute every request's readings (one right-padded forward of the model, read by our own hooks)."""
        att = self.att
        ids, mask = padded(seqs)
        shape = (*ids.shape, self.adapter.d_model)
        bufs = {key: torch.zeros(shape, dtype=torch.float64) for key in att.layout.slots}
        handles = []
        for key, (module, where, _) in att.layout.slots.items():
            handles.append(self._hook(module, where, bufs[key]))
        try:
            run = torch.compile(self.model, fullgraph=True) if self.compiled else self.model
            with torch.no_grad():
                run(input_ids=ids, attention_mask=mask)
        finally:
            for h in handles:
                h.remove()
        for r, (k, s) in enumerate(seqs.items()):
            self.readings[k] = {
                role: bufs[key][r, : len(s)] for key, roles in att.layout.roles.items() for role in roles[0]
            }

    def _hook(self, module, where, buf):
        def write(x):
            if not torch.compiler.is_compiling():
                self.python_reads += 1
            buf.copy_(x)

        if where == "input":
            return module.register_forward_pre_hook(lambda m, args, kw: write(kw.get("hidden_states", args[0])),
                                                    with_kwargs=True)  # fmt: skip
        return module.register_forward_hook(lambda m, args, out: write(out[0] if isinstance(out, tuple) else out))

    def forward(self, schedule: list[tuple]) -> None:
        """One engine forward: (key, start, stop) per scheduled request, its tokens start..stop, flat."""
        rec, keys = self.att.record, tuple(k for k, _, _ in schedule)
        row = torch.cat([torch.full((b - a,), r) for r, (_, a, b) in enumerate(schedule)])
        position = torch.cat([torch.arange(a, b) for _, a, b in schedule])
        rec.forward_start(CallFacts(attn_ran=self.att.untapped, flat=FlatRows(keys, row, position)))
        for role in self.att.roles:
            x = torch.cat([self.readings[k][role][a:b] for k, a, b in schedule])  # (tokens, d)
            rec.read(*role, x)
        rec.forward_end(True)

    def finish(self, keys) -> None:
        """The scheduler finished these requests."""
        self.att.record.requests_end(keys)


@dataclasses.dataclass
class FlatAdapter(Adapter):
    """The model's own adapter, whose attachment is the engine's."""

    engine: FlatEngine | None = None

    def attachment(self, layers, points, record, warn, read_mask=True, layout=None):
        return FlatAttachment(self, layers, points, record)


class FlatAttachment(Attachment):
    """The engine's side of the interface: it knows where readings are taken (``TapLayout``) and tells the record."""

    def __init__(self, adapter: FlatAdapter, layers, points, record):
        self.engine, self.record = adapter.engine, record
        self.layout = TapLayout.build(adapter, layers, points)
        self.untapped = frozenset(self.layout.attn_paths)  # attentions read by no tap: the engine ran them
        self.roles = [role for roles in self.layout.roles.values() for role in roles[0]]

    def attach(self) -> None:
        self.engine.att = self

    def detach(self) -> None:
        self.engine.att = None


def worker(spec, seqs: dict, schedule: list, out) -> None:
    """Another process: the same model, a record made from ``spec``, the engine's forwards; its state sent back."""
    engine = FlatEngine(tiny_llama(0))
    record, att = spec.attach(engine.adapter)
    engine.prefill(seqs)
    for step in schedule:
        if step[0] == "end":
            engine.finish(step[1])
        else:
            engine.forward(step)
    att.detach()
    out.put(record.state_dict())
