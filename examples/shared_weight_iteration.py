"""Iterate ALBERT's shared layer far past its depth and compare the limit with the spectrum.

1. A planted ALBERT whose F has a complex dominant eigenvalue: in paper mode the tokens
   gather in the plane of (Re v_1, Im v_1) and rotate by arg(1 + lambda_1) per step.
2. The zoo ALBERT, in model mode (the real block with its FFN and LayerNorm).
"""

import math

import torch

import eigenhooks as eh
from eigenhooks.dynamics import trajectory as D
from eigenhooks.dynamics.planted import planted_albert, planted_matrix

lam = 1.5 * complex(math.cos(0.6), math.sin(0.6))
planted = planted_albert(planted_matrix([lam], 16, seed=1))
x0 = torch.randn(1, 10, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
tr = D.iterate(planted, x0, layer=0, steps=200, mode="paper")
pred, meas = D.predict_limit(tr.spectrum), D.classify_limit(tr)
print(
    f"planted: predicted {pred.kind} at {pred.angle:.4f} rad/step, measured {meas.kind} at {meas.angle:.4f}; "
    f"agree {D.agree(pred, meas)}"
)
try:
    from eigenhooks import plots

    plots.trajectories(
        torch.stack(tr.coords[-40:]).numpy(), "planted ALBERT, paper mode", ("Re v_1", "Im v_1")
    ).savefig("trajectories.png", dpi=100)
    print("wrote trajectories.png")
except ImportError:
    print("matplotlib not installed: no plot")

model, tok = eh.zoo.load("albert-tiny")
inp = tok(["The for statement is used to iterate over a sequence"], return_tensors="pt")
for mode in ("paper", "model"):
    tr = D.iterate(model, inp, layer=0, steps=500, mode=mode)
    pred, meas = D.predict_limit(tr.spectrum), D.classify_limit(tr)
    print(
        f"zoo albert, {mode} mode: lambda_1 {tr.spectrum.lambda_1:.4f} ({tr.spectrum.kind}); predicted "
        f"{pred.kind}, measured {meas.kind}, final alignment {meas.detail['alignment']:.3f}, "
        f"consensus {meas.detail['consensus']:.3f}"
    )
