"""matplotlib figures for runs: alignment per layer, spectra, token heatmaps, trajectories.

matplotlib is optional (``pip install 'eigenhooks[plot]'``) and imported lazily; every
function returns a Figure and never calls ``show``.
"""

from __future__ import annotations

import math


def _plt():
    """pyplot, with the Agg backend only where nobody chose one.

    A backend already chosen (a notebook's inline backend, ``MPLBACKEND``, a matplotlibrc, a
    ``matplotlib.use`` call, pyplot already imported) is left alone, so a returned Figure shows
    as an image in Jupyter. Where none was chosen (the CLI, a script) Agg is used: the figures
    are written to files, and no GUI toolkit is started.
    """
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("plots need matplotlib: pip install 'eigenhooks[plot]'") from e
    if _backend_unchosen(matplotlib):
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _backend_unchosen(matplotlib) -> bool:
    """True while rcParams still holds matplotlib's 'resolve on first use' sentinel.

    Read without resolving it: ``rcParams["backend"]`` would pick a backend (and import pyplot)."""
    sentinel = getattr(matplotlib.rcsetup, "_auto_backend_sentinel", None)
    return sentinel is not None and dict.__getitem__(matplotlib.rcParams, "backend") is sentinel


def alignment_by_layer(summary, target: str = "ov/modulus"):
    """rho per layer with its 95% CI, against the Haar null's 95% band; gamma against its null.

    The null is measured on every null_stride-th token of each sequence, and the verdict compares the
    target's rho on those same tokens (``rho_null_tokens``): it is drawn as a ring, and the verdict's
    marker sits on it, since with few tokens it can stand apart from rho on all of them.

    Args:
        summary: the DataFrame of ``Monitor.summary()`` (or a run's summary.csv).
        target: which target's rows ('ov/modulus', 'ov/residual', a custom name, or just
            'modulus' / 'residual').
    """
    plt = _plt()
    if "/" not in target and target in ("modulus", "residual"):
        target = f"ov/{target}"
    df = summary[summary["target"] == target].sort_values("layer")
    if df.empty:
        raise ValueError(f"no rows for target {target!r}; targets: {sorted(set(summary['target']))}")
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7.5, 6.5), sharex=True)
    x = df["layer"].to_numpy()
    ax.fill_between(
        x, df["null_gamma_pre_lo"], df["null_gamma_pre_hi"], color="grey", alpha=0.25, label="null γ_pre 95%"
    )
    ax.plot(x, df["gamma_pre"], "o-", label="γ_pre")
    ax.plot(x, df["gamma_mid"], "s-", label="γ_mid")
    ax.set_ylabel("mean alignment γ")
    ax.set_title(f"{target}: alignment per layer against the Haar null")
    ax.legend(fontsize=8)
    ax2.fill_between(x, df["null_rho_lo"], df["null_rho_hi"], color="grey", alpha=0.3, label="null ρ 95% band")
    ax2.plot(x, df["null_rho_mean"], color="grey", lw=0.8, ls="--")
    lo = (df["rho"] - df["rho_ci_lo"]).clip(lower=0).fillna(0)
    hi = (df["rho_ci_hi"] - df["rho"]).clip(lower=0).fillna(0)
    ax2.errorbar(x, df["rho"], yerr=[lo, hi], fmt="o", color="C0", capsize=3, label="ρ, 95% CI")
    # the band, pct, p and the verdict compare rho on the null's own tokens (every null_stride-th one)
    tested = df["rho_null_tokens"] if "rho_null_tokens" in df else df["rho"]
    if "null_tokens" in df and (df["null_tokens"] < df["n_tokens"]).any():
        ax2.scatter(
            x, tested, marker="o", s=60, facecolors="none", edgecolors="k", zorder=3, label="ρ on the null's tokens"
        )
    marks = {"toward": ("^", "C2"), "away": ("v", "C3")}
    for verdict, (mk, col) in marks.items():
        sel = df["verdict"] == verdict
        if sel.any():
            ax2.scatter(
                x[sel.to_numpy()], tested[sel], marker=mk, s=80, color=col, zorder=3, label=f"{verdict} (q < 0.05)"
            )
    ax2.axhline(0.5, color="k", lw=0.6, ls=":")
    ax2.set_ylim(0, 1.05)
    ax2.set_xticks(x)
    ax2.set_xlabel("layer")
    ax2.set_ylabel("ρ = P(alignment grows)")
    ax2.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return fig


def eigenvalue_planes(spectra, max_cols: int = 4):
    """Each layer's eigenvalues in the complex plane, unit circle drawn, lambda_1 marked."""
    plt = _plt()
    n = len(spectra)
    cols = min(max_cols, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3 * cols, 3 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    for ax, s in zip(axes.flat, spectra):
        ev = s.eigenvalues.numpy()
        t = [2 * math.pi * i / 200 for i in range(201)]
        ax.plot([math.cos(a) for a in t], [math.sin(a) for a in t], color="grey", lw=0.6)
        ax.scatter(ev.real, ev.imag, s=6, alpha=0.6)
        ax.scatter([s.lambda_1.real], [s.lambda_1.imag], s=40, color="red", marker="*", label="lambda_1")
        ax.axhline(0, color="k", lw=0.3)
        ax.axvline(0, color="k", lw=0.3)
        ax.set_title(f"layer {s.layer}: {s.kind}", fontsize=9)
        ax.set_aspect("equal", adjustable="datalim")
    fig.tight_layout()
    return fig


def token_heatmap(values, tokens: list[str] | None = None, title: str = "alignment a(x) at 'pre'"):
    """A tokens x layers heatmap. values: (layers, tokens) array-like."""
    plt = _plt()
    import numpy as np

    v = np.asarray(values, dtype=float)
    fig, ax = plt.subplots(figsize=(max(6, 0.25 * v.shape[1]), 0.4 * v.shape[0] + 1.5))
    im = ax.imshow(v, aspect="auto", cmap="viridis", vmin=0, vmax=max(1e-9, float(np.nanmax(v))))
    ax.set_ylabel("layer")
    ax.set_xlabel("token")
    if tokens is not None and len(tokens) <= 80:
        ax.set_xticks(range(len(tokens)))
        ax.set_xticklabels([readable(t) for t in tokens], rotation=90, fontsize=7)
    ax.set_title(title)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    return fig


def readable(token: str) -> str:
    """A token's text as people read it in a label: newlines and tabs shown, spaces kept visible."""
    t = token.replace("\n", "⏎").replace("\t", "⇥")
    return t if t.strip() else repr(token)[1:-1] or "∅"


def trajectories(coords, title: str = "token trajectories", labels: tuple[str, str] = ("v_1", "v_2")):
    """Token paths in a plane. coords: (steps, tokens, 2) array-like."""
    plt = _plt()
    import numpy as np

    c = np.asarray(coords, dtype=float)
    fig, ax = plt.subplots(figsize=(5, 5))
    for j in range(c.shape[1]):
        ax.plot(c[:, j, 0], c[:, j, 1], lw=0.8, alpha=0.7)
        ax.scatter(c[-1, j, 0], c[-1, j, 1], s=12)
    ax.set_xlabel(labels[0])
    ax.set_ylabel(labels[1])
    ax.set_title(title)
    ax.set_aspect("equal", adjustable="datalim")
    fig.tight_layout()
    return fig
