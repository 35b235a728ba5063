"""Models dispatched with accelerate: spectra read offloaded weights layer by layer, and
the monitor runs on them, with the same results as the plain model."""

from __future__ import annotations

import pytest
import torch
from harness import build

import eigenhooks as eh
from eigenhooks.models import offload
from eigenhooks.spectra import compute

accelerate = pytest.importorskip("accelerate")

TEXTS = ["def f(x):\n    return x + 1", "class A:\n    pass"]
FAMILIES = ["llama", "gpt2", "bert"]  # GQA pre-norm, Conv1D, post-norm


def _cpu_offloaded(family):
    model = build(family, dtype=torch.float32)
    accelerate.cpu_offload(model, execution_device="cpu")
    return model


def _disk_offloaded(family, tmp_path):
    """Saved and reloaded with from_pretrained(device_map=...): the blocks on disk."""
    plain = build(family, dtype=torch.float32)
    plain.save_pretrained(tmp_path / "ckpt")
    blocks = eh.get_adapter(plain).layers
    names = {m: n for n, m in plain.named_modules()}
    disk = [names[ly.block] for ly in blocks]
    device_map = {n: "disk" for n in disk}
    for n, m in plain.named_modules():  # everything else stays on the CPU, not offloaded
        inside = any(n == b or n.startswith(f"{b}.") for b in disk)
        direct = list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False))
        if direct and not inside:
            device_map[n] = "cpu"
    model = type(plain).from_pretrained(
        tmp_path / "ckpt", device_map=device_map, offload_folder=str(tmp_path / "offload"), dtype=torch.float32
    )
    return model.eval()


def _assert_same_spectra(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x.eigenvalues, y.eigenvalues, atol=1e-9, rtol=0)
        torch.testing.assert_close(x.basis, y.basis, atol=1e-7, rtol=0)
        assert (x.kind, x.k) == (y.kind, y.k)


def _meta_params(model):
    return [n for n, p in model.named_parameters() if p.device.type == "meta"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("how", ["cpu_offload", "disk"])
def test_offloaded_spectra_equal_plain(family, how, tmp_path):
    plain = build(family, dtype=torch.float32)
    model = _cpu_offloaded(family) if how == "cpu_offload" else _disk_offloaded(family, tmp_path)
    meta = _meta_params(model)
    assert meta and offload.is_offloaded(model), "the fixture offloaded nothing"
    for variant in ("ov", "ov_ln"):
        for rank in ("modulus", "residual"):
            ref = eh.spectra(plain, variant=variant, rank=rank, cache=False)
            _assert_same_spectra(ref, eh.spectra(model, variant=variant, rank=rank, cache=False))
    _assert_same_spectra(eh.spectra(plain, heads=True, cache=False), eh.spectra(model, heads=True, cache=False))
    assert _meta_params(model) == meta, "spectra left offloaded weights materialised"


def test_offloaded_layers_are_read_one_at_a_time(monkeypatch):
    """Only one layer's attention modules are in memory at any moment, never an MLP."""
    model = _cpu_offloaded("llama")
    names = {id(m): n for n, m in model.named_modules()}
    loaded: set[str] = set()
    widest: list[set[str]] = []
    real = offload._onload_one

    def spy(module, hook):
        name = names[id(module)]
        loaded.add(name)
        widest.append(set(loaded))
        cm = real(module, hook)

        class _Ctx:
            def __enter__(self):
                return cm.__enter__()

            def __exit__(self, *exc):
                loaded.discard(name)
                return cm.__exit__(*exc)

        return _Ctx()

    monkeypatch.setattr(offload, "_onload_one", spy)
    specs = eh.spectra(model, variant="ov_ln", cache=False)
    assert len(specs) == 2 and widest
    layers_at_once = max(len({n.split(".")[2] for n in s}) for s in widest)
    assert layers_at_once == 1, widest
    assert not any("mlp" in n for s in widest for n in s)
    assert any("o_proj" in n for s in widest for n in s) and any("input_layernorm" in n for s in widest for n in s)


def _onloaded_names(monkeypatch, model) -> set[str]:
    names = {id(m): n for n, m in model.named_modules()}
    seen: set[str] = set()
    real = offload._onload_one

    def spy(module, hook):
        seen.add(names[id(module)])
        return real(module, hook)

    monkeypatch.setattr(offload, "_onload_one", spy)
    return seen


@pytest.mark.parametrize("variant", ["ov", "ov_ln"])
def test_offloaded_spectra_bring_in_only_the_value_and_output_weights(monkeypatch, variant):
    """F = O V needs v_proj and o_proj: q_proj and k_proj (as large as o_proj in a 70B
    model) stay offloaded; the norm comes in only for ov_ln."""
    model = _cpu_offloaded("llama")
    seen = _onloaded_names(monkeypatch, model)
    specs = eh.spectra(model, variant=variant, cache=False)
    _assert_same_spectra(eh.spectra(build("llama", dtype=torch.float32), variant=variant, cache=False), specs)
    kinds = {n.rsplit(".", 1)[-1] for n in seen}
    want = {"v_proj", "o_proj"} | ({"input_layernorm"} if variant == "ov_ln" else set())
    assert kinds == want, sorted(seen)


def test_offloaded_factor_rule_that_is_not_a_view_brings_in_the_whole_attention(monkeypatch):
    """A rule whose factors are computed (no view of a parameter) falls back to the whole attention."""
    model = _cpu_offloaded("llama")
    adapter = eh.get_adapter(model)
    for ly in adapter.layers:
        rule = ly.factors
        ly.factors = lambda rule=rule: (lambda f: type(f)(f.O_heads * 1.0, f.V_groups, f.group_of_head))(rule())
    seen = _onloaded_names(monkeypatch, model)
    _assert_same_spectra(eh.spectra(build("llama", dtype=torch.float32), cache=False), eh.spectra(adapter, cache=False))
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= {n.rsplit(".", 1)[-1] for n in seen}, sorted(seen)


def test_offloaded_disk_cache_round_trip(tmp_path):
    """The content-keyed disk cache serves an offloaded model (no in-process memo for it)."""
    model = _disk_offloaded("llama", tmp_path)
    first = eh.spectra(model)
    compute.clear_memo()
    _assert_same_spectra(first, eh.spectra(model))
    _assert_same_spectra(first, eh.spectra(build("llama", dtype=torch.float32), cache=False))


@pytest.mark.parametrize("family", ["llama", "bert"])
@pytest.mark.parametrize("how", ["cpu_offload", "disk"])
def test_monitored_forward_on_offloaded_model(family, how, tmp_path):
    import transformers as T

    tok = T.PreTrainedTokenizerFast(tokenizer_object=_char_tokenizer(), pad_token="<pad>")
    batch = tok(TEXTS, return_tensors="pt", padding=True)
    frames = []
    for model in (build(family, dtype=torch.float32), None):
        if model is None:
            model = _cpu_offloaded(family) if how == "cpu_offload" else _disk_offloaded(family, tmp_path)
        with eh.monitor(model) as mon:
            with torch.no_grad():
                model(**batch)
        frames.append(mon.summary())
    plain, off = (f.select_dtypes("number").reset_index(drop=True) for f in frames)
    assert len(plain) == len(off) > 0 and "rho" in plain and plain["rho"].notna().all()
    import pandas as pd

    pd.testing.assert_frame_equal(plain, off, rtol=1e-5, atol=1e-6)


def _char_tokenizer():
    """A character-level tokenizer with ids below the tiny models' vocabulary (64)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    chars = sorted(set("".join(TEXTS)))
    vocab = {"<pad>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    assert len(vocab) < 64
    t = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    t.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return t


def test_empty_meta_model_is_refused_with_fitting_advice():
    import transformers as T

    with accelerate.init_empty_weights():
        model = T.LlamaForCausalLM(build("llama").config)
    with pytest.raises(ValueError, match=r"no offload map holds .*init_empty_weights.*load_checkpoint_and_dispatch"):
        eh.spectra(model)
    with pytest.raises(ValueError, match="no offload map holds"):
        eh.monitor(model)


def test_partly_empty_offloaded_model_names_the_empty_parameter():
    model = _cpu_offloaded("llama")
    hook = model.model.layers[1].self_attn.v_proj._hf_hook
    hook.weights_map = {}  # the map lost its entry: that weight is empty, the rest offloaded
    with pytest.raises(ValueError, match=r"1 parameter\(s\).*'model\.layers\.1\.self_attn\.v_proj\.weight'"):
        eh.get_adapter(model)


def test_weights_still_meta_after_onload_is_explained():
    """An adapter built on real weights that were later moved to meta: nothing can load them."""
    model = build("llama", dtype=torch.float32)
    adapter = eh.get_adapter(model)
    model.to("meta")
    with pytest.raises(ValueError, match=r"layer 0 .*still on the meta device after loading"):
        eh.spectra(adapter, cache=False)


def test_weights_in_place_are_not_looked_for_in_the_model(monkeypatch):
    """A layer whose weights are all in place (none on meta) brings nothing in, and the model's modules
    are not walked for offload hooks: a monitor's entry asks this once a layer."""
    model = build("llama", dtype=torch.float32)
    attn = model.model.layers[1].self_attn
    monkeypatch.setattr(offload, "_modules_to_onload", lambda *a: pytest.fail("the model was walked"))
    with offload.onloaded(model, [attn, None]) as loaded:
        assert loaded is False
