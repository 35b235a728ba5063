"""TransformerLens 3's HookedTransformer as a backend, on random-weight GPT-style and GQA/rotary configs.

Runs where HookedTransformer exists (TransformerLens 3.x, CI's lens-3 environment); TransformerLens 4
removed it. Every F is checked against an independent reading of W_V/W_O in TransformerLens's row
convention, before and after ``process_weights_``.
"""

import copy

import pytest
import torch

import eigenhooks as eh

tl = pytest.importorskip("transformer_lens", reason="TransformerLens not installed (pip install 'eigenhooks[lens]')")
try:
    tl.HookedTransformer  # noqa: B018  (TransformerLens 4 raises ImportError here, not AttributeError)
except (ImportError, AttributeError):
    pytest.skip("this TransformerLens has no HookedTransformer (removed in 4.0)", allow_module_level=True)

D = 16
CONFIGS = {
    "gpt": dict(n_heads=2, d_head=8, act_fn="gelu", normalization_type="LN"),
    "gqa-rotary": dict(
        n_heads=4,
        n_key_value_heads=2,
        d_head=4,
        act_fn="silu",
        gated_mlp=True,
        normalization_type="RMS",
        positional_embedding_type="rotary",
        rotary_dim=4,
    ),
}


def _model(kind: str, processed: bool):
    cfg = tl.HookedTransformerConfig(
        n_layers=2, d_model=D, d_mlp=32, d_vocab=64, n_ctx=32, seed=0, dtype=torch.float64, **CONFIGS[kind]
    )
    m = tl.HookedTransformer(cfg)
    assert sum(p.numel() for p in m.parameters()) < 20_000  # really tiny
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for blk in m.blocks:  # scales away from 1 and random W_O biases, so processing shows in F
            blk.ln1.w.copy_(0.5 + torch.rand(D, generator=g, dtype=torch.float64))
            if hasattr(blk.ln1, "b"):
                blk.ln1.b.copy_(0.1 * torch.randn(D, generator=g, dtype=torch.float64))
    if processed:
        m.process_weights_(fold_ln=True, center_writing_weights=True, center_unembed=True)
    return m.eval()


def _F_rows(attn) -> torch.Tensor:
    """F from TransformerLens's own W_V/W_O (row vectors): OV = sum_h W_V[h] W_O[h], F = OV^T.

    ``attn.W_V`` repeats each key/value group for its query heads, so GQA needs no grouping here."""
    OV = torch.einsum("hdk,hke->de", attn.W_V, attn.W_O)  # (d_model, d_model), x_row @ OV
    return OV.T


@pytest.mark.parametrize("processed", [False, True], ids=["raw", "processed"])
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_spectra_and_verify_match_W_O_W_V(kind, processed):
    m = _model(kind, processed)
    ad = eh.get_adapter(m)
    assert ad.family == "lens-hooked" and ad.n_kv_heads == CONFIGS[kind].get("n_key_value_heads", ad.n_heads)
    specs = eh.spectra(m, cache=False)
    for i, blk in enumerate(m.blocks):
        F = _F_rows(blk.attn)
        torch.testing.assert_close(ad.factors(i).matrix(), F, atol=1e-12, rtol=0)
        ref = torch.linalg.eigvals(F)
        top = ref[ref.abs().argmax()]
        assert abs(abs(specs[i].lambda_1) - float(top.abs())) < 1e-10
        assert min(abs(specs[i].lambda_1 - complex(top)), abs(specs[i].lambda_1 - complex(top.conj()))) < 1e-10
    # F from the model's own forward: attention fed identical tokens (ln1's output replaced)
    for r in eh.verify(m, n_tokens=1):
        assert r.max_abs_diff < 1e-10, r
    for r in eh.verify(m, n_tokens=3):
        assert r.max_abs_diff < 1e-6, r  # the softmax averages for real; rotary scores in float32


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_notes_name_what_process_weights_did_to_F(kind):
    raw = _model(kind, processed=False)
    F_raw = [eh.get_adapter(raw).factors(i).matrix() for i in range(2)]
    w = [blk.ln1.w.detach().clone() for blk in raw.blocks]
    note_raw = eh.get_adapter(raw).notes[0]
    assert "unprocessed" in note_raw and "fold_ln" in note_raw

    done = copy.deepcopy(raw)
    done.process_weights_(fold_ln=True, center_writing_weights=True, center_unembed=True)
    note = eh.get_adapter(done).notes[0]
    assert "processed weights" in note and "fold_ln folded ln1's scale into W_V" in note
    P = torch.eye(D, dtype=torch.float64) - 1.0 / D
    layer_norm = CONFIGS[kind]["normalization_type"] == "LN"
    # TransformerLens centres only around LayerNorm (RMSNorm does not subtract a mean)
    assert ("W_O has zero mean over d_model (center_writing_weights)" in note) == layer_norm
    for i in range(2):
        expected = F_raw[i] @ torch.diag(w[i])
        if layer_norm:
            expected = P @ expected @ P  # W_O centred (writing), W_V centred after the fold (reading)
        got = eh.get_adapter(done).factors(i).matrix()
        assert (got - F_raw[i]).abs().max() > 1e-2  # processing really changed F
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)  # TransformerLens folds in float32


def _ablate_head0(z, hook):
    z[:, :, 0] = 0.0  # (batch, pos, head, d_head)
    return z


COLUMNS = ["layer", "target", "gamma_pre", "gamma_mid", "rho", "n_tokens"]


@pytest.mark.parametrize("processed", [False, True], ids=["raw", "processed"])
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_monitor_with_block_and_fwd_hooks_next_to_an_ablation(kind, processed):
    m = _model(kind, processed)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    ablation = ("blocks.0.attn.hook_z", _ablate_head0)

    with eh.monitor(m) as mon:
        m(tokens)
    plain = mon.summary()
    assert len(plain) == 2 * 2 and plain["n_tokens"].eq(24).all() and plain["rho"].notna().all()

    with m.hooks(fwd_hooks=[ablation]):  # the user's ablation, and the monitor as a with-block
        with eh.monitor(m) as mon:
            m(tokens)
    ablated = mon.summary()

    mon = eh.monitor(m, attach=False)  # the monitor's hooks inside run_with_hooks, beside the ablation
    m.run_with_hooks(tokens, fwd_hooks=[ablation, *mon.fwd_hooks()])
    via_hooks = mon.summary()

    cols = [c for c in COLUMNS if c in plain.columns]
    assert set(cols) >= {"gamma_pre", "gamma_mid", "rho"}
    torch.testing.assert_close(
        torch.tensor(via_hooks[cols[2:]].to_numpy(float)), torch.tensor(ablated[cols[2:]].to_numpy(float))
    )
    # the ablation is measured: layer 0's mid (after attention) moved, its pre did not
    l0 = plain["layer"] == 0
    assert plain[l0]["gamma_pre"].to_numpy() == pytest.approx(ablated[l0]["gamma_pre"].to_numpy(), abs=1e-12)
    assert abs(plain[l0]["gamma_mid"].to_numpy() - ablated[l0]["gamma_mid"].to_numpy()).max() > 1e-4
