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


def _target_rows(summary, target: str):
    if "/" not in target and target in ("modulus", "residual"):
        target = f"ov/{target}"
    df = summary[summary["target"] == target].sort_values("layer")
    if df.empty:
        raise ValueError(f"no rows for target {target!r}; targets: {sorted(set(summary['target']))}")
    return target, df


VERDICT_MARKS = {"toward": ("^", "C2", 1), "away": ("v", "C3", -1)}  # marker, colour, side of the point
MARK_OFFSET_PT, MARK_SIZE = 9.0, 40  # the verdict sits 9 pt beside its point, never on it
RHO_YLIM = (-0.14, 1.14)  # room for a verdict marker at rho = 0 or 1, inside the axes


def draw_tilt(ax, df, target: str) -> None:
    """The verdict's test, on ``ax``: the tilt Δγ per layer with its 95% interval over sequences, against the band
    of directions drawn from the stream's own covariance (the verdict's null), the verdict's marker beside it."""
    from matplotlib.transforms import offset_copy

    x = df["layer"].to_numpy()
    if "tilt" not in df or df["tilt"].isna().all():  # an older run's summary, or too few sequences everywhere
        why = "no verdict columns in this summary" if "tilt" not in df else "too few sequences for a verdict"
        ax.text(0.5, 0.5, why, transform=ax.transAxes, ha="center", va="center", color="grey")
        ax.set_title(f"{target}: the tilt per layer (the verdict's test)", fontsize=10)
        return
    ax.margins(y=0.25)  # room for a verdict's marker beside the highest and lowest points
    ax.fill_between(
        x, df["tilt_null_lo"], df["tilt_null_hi"], color="grey", alpha=0.3, label="null Δγ 95% (stream's directions)"
    )
    ax.plot(x, df["tilt_null_median"], color="grey", lw=0.8, ls="--", label="null Δγ median")
    lo = (df["tilt"] - df["tilt_ci_lo"]).clip(lower=0).fillna(0)
    hi = (df["tilt_ci_hi"] - df["tilt"]).clip(lower=0).fillna(0)
    ax.errorbar(x, df["tilt"], yerr=[lo, hi], fmt="o", ms=4, color="C0", capsize=3, label="Δγ, 95% CI", zorder=4)
    for verdict, (mk, col, side) in VERDICT_MARKS.items():
        sel = (df["verdict"] == verdict).to_numpy()
        if sel.any():
            beside = offset_copy(ax.transData, fig=ax.figure, y=side * MARK_OFFSET_PT, units="points")
            ax.scatter(
                x[sel], df["tilt"].to_numpy()[sel], marker=mk, s=MARK_SIZE, color=col, transform=beside, zorder=3,
                label=f"{verdict} (q < 0.05)",
            )  # fmt: skip
    ax.axhline(0.0, color="k", lw=0.6, ls=":", label="Δγ = 0")
    ax.set_ylabel("Δγ = γ mid − γ pre")
    ax.set_title(f"{target}: the tilt per layer against directions the stream favours (the verdict)", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def draw_rho(ax, df, target: str) -> None:
    """rho per layer with its 95% CI against the Haar null's 95% band, on ``ax``.

    The Haar null is measured on every null_stride-th token of each sequence, and its band compares the
    target's rho on those same tokens (``rho_null_tokens``), drawn as a ring. Descriptive: the verdict tests
    Δγ against another null (``draw_tilt``), and its markers are drawn there, not here.
    """
    x = df["layer"].to_numpy()
    ax.fill_between(x, df["null_rho_lo"], df["null_rho_hi"], color="grey", alpha=0.3, label="null ρ 95% band")
    ax.plot(x, df["null_rho_mean"], color="grey", lw=0.8, ls="--", label="null ρ mean")
    lo = (df["rho"] - df["rho_ci_lo"]).clip(lower=0).fillna(0)
    hi = (df["rho_ci_hi"] - df["rho"]).clip(lower=0).fillna(0)
    ax.errorbar(x, df["rho"], yerr=[lo, hi], fmt="o", ms=4, color="C0", capsize=3, label="ρ, 95% CI", zorder=4)
    tested = df["rho_null_tokens"] if "rho_null_tokens" in df else df["rho"]
    if "null_tokens" in df and (df["null_tokens"] < df["n_tokens"]).any():
        ax.scatter(
            x, tested, marker="o", s=50, facecolors="none", edgecolors="k", zorder=5, label="ρ on the null's tokens"
        )
    ax.axhline(0.5, color="k", lw=0.6, ls=":", label="ρ = 0.5: as many tokens tilt away as toward")
    ax.set_ylim(*RHO_YLIM)
    ax.set_ylabel("ρ = P(alignment grows)")
    ax.set_title(f"{target}: ρ per layer against the Haar null", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def draw_gamma(ax, df) -> None:
    """Mean alignment gamma before and after the attention step against gamma_pre's null band, on ``ax``."""
    x = df["layer"].to_numpy()
    ax.fill_between(
        x, df["null_gamma_pre_lo"], df["null_gamma_pre_hi"], color="grey", alpha=0.25, label="null γ_pre 95%"
    )
    ax.plot(x, df["gamma_pre"], "o-", ms=3, label="γ_pre")
    ax.plot(x, df["gamma_mid"], "s-", ms=3, label="γ_mid")
    ax.set_ylabel("mean alignment γ")
    ax.set_xlabel("layer")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _layer_ticks(ax, x) -> None:
    from matplotlib.ticker import MaxNLocator

    if len(x) <= 16:
        ax.set_xticks(x)
    else:  # 30 layers: every few, readable
        ax.xaxis.set_major_locator(MaxNLocator(nbins=15, integer=True))


def alignment_by_layer(summary, target: str = "ov/modulus"):
    """The tilt Δγ per layer with its interval against the verdict's null (top: what the verdict tests); rho
    against the Haar null's band; gamma against its null (below). A pyplot Figure, as the run folder saves it.

    Args:
        summary: the DataFrame of ``Monitor.summary()`` (or a run's summary.csv).
        target: which target's rows ('ov/modulus', 'ov/residual', a custom name, or just
            'modulus' / 'residual').
    """
    plt = _plt()
    target, df = _target_rows(summary, target)
    fig, (ax0, ax, ax2) = plt.subplots(3, 1, figsize=(9, 9), sharex=True, height_ratios=(3, 2, 2))
    draw_tilt(ax0, df, target)
    draw_rho(ax, df, target)
    ax.set_title("ρ against the Haar null", fontsize=9)
    draw_gamma(ax2, df)
    _layer_ticks(ax2, df["layer"].to_numpy())
    fig.tight_layout()
    return fig


def by_layer(summary, target: str | None = None):
    """``Monitor.plot``: the tilt by layer against the verdict's null, then rho against the Haar null's band, then
    gamma, one column per target (``target``:
    one of them, e.g. 'modulus'; None: every target of ``summary``), in one Figure.

    The Figure is made without pyplot, so a notebook shows it once, as the cell's value; pyplot is
    imported only so that a notebook's inline backend is in place to draw it.
    """
    _plt()
    from matplotlib.figure import Figure

    targets = [target] if target is not None else list(dict.fromkeys(summary["target"]))
    frames = [_target_rows(summary, t) for t in targets]
    fig = Figure(figsize=(7.5 * len(frames), 9), layout="constrained")
    axes = fig.subplots(3, len(frames), squeeze=False, sharex="col", height_ratios=(3, 2, 2))
    for col, (name, df) in enumerate(frames):
        draw_tilt(axes[0, col], df, name)
        draw_rho(axes[1, col], df, name)
        axes[1, col].set_title("ρ against the Haar null", fontsize=9)
        draw_gamma(axes[2, col], df)
        _layer_ticks(axes[2, col], df["layer"].to_numpy())
    return fig


def eigenvalue_planes(spectra, max_cols: int = 4):
    """Each layer's eigenvalues in the complex plane, unit circle drawn, lambda_1 marked."""
    plt = _plt()
    n = len(spectra)
    cols = min(max_cols if n <= 16 else 6, n)  # 30 layers: 6 x 5 panels of 2 inches, not 4 x 8 of 3
    rows = math.ceil(n / cols)
    side = 3 if cols <= 4 else 2
    fig, axes = plt.subplots(rows, cols, figsize=(side * cols, side * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    for ax, s in zip(axes.flat, spectra):
        ev = s.eigenvalues.numpy()
        t = [2 * math.pi * i / 200 for i in range(201)]
        ax.plot([math.cos(a) for a in t], [math.sin(a) for a in t], color="grey", lw=0.6, label="unit circle |λ| = 1")
        ax.scatter(ev.real, ev.imag, s=6, alpha=0.6, label="eigenvalues of F")
        ax.scatter([s.lambda_1.real], [s.lambda_1.imag], s=40, color="red", marker="*", label="λ1")
        ax.axhline(0, color="k", lw=0.3, label="real and imaginary axes")
        ax.axvline(0, color="k", lw=0.3, label="_the imaginary axis: one entry with the real one")
        ax.set_title(f"layer {s.layer}\n{s.kind}", fontsize=9)  # two lines: "complex-dominant" fits a 2-inch panel
        ax.set_aspect("equal", adjustable="datalim")
    if n:  # one legend for every panel, above them
        fig.legend(*axes.flat[0].get_legend_handles_labels(), loc="upper center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / (side * rows)))  # room for the legend's line
    return fig


TICK_PT = 9  # tick labels of the heat map: 9 pt, 13.75 px at the run folder's 110 dpi
PER_PANEL = 48  # tokens per panel: 48 labels of 9 pt fit an 11-inch row


def token_heatmap(values, tokens: list[str] | None = None, title: str = "alignment a(x) at 'pre'", per_panel=PER_PANEL):
    """A layers x tokens heatmap, split into rows of at most ``per_panel`` tokens so that every token's
    label reads at 9 pt in an 11-inch wide figure (a long sequence: more rows, never smaller labels).

    Args:
        values: (layers, tokens) array-like.
        tokens: the tokens' text, one per column; None: no labels.
    """
    plt = _plt()
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    v = np.asarray(values, dtype=float)
    n_layers, n = v.shape
    panels = max(1, math.ceil(n / per_panel))
    per = max(1, math.ceil(n / panels))  # balanced: 128 tokens make rows of 43, 43 and 42
    row_in = max(1.4, 0.1 * n_layers + 0.5) + (1.0 if tokens is not None else 0.3)
    fig, axes = plt.subplots(panels, 1, figsize=(11, row_in * panels + 0.6), squeeze=False, layout="constrained")
    vmax = max(1e-9, float(np.nanmax(v))) if v.size else 1.0
    for p, ax in enumerate(axes[:, 0]):
        lo, hi = p * per, min(n, (p + 1) * per)
        im = ax.imshow(
            v[:, lo:hi], aspect="auto", cmap="viridis", vmin=0, vmax=vmax,
            extent=(lo - 0.5, hi - 0.5, n_layers - 0.5, -0.5),
        )  # fmt: skip
        ax.set_xlim(lo - 0.5, lo + per - 0.5)  # every row as wide as a full one: a token has one width
        ax.set_ylabel("layer", fontsize=TICK_PT)
        ax.yaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))
        ax.tick_params(labelsize=TICK_PT)
        if tokens is not None:
            ax.set_xticks(range(lo, hi))
            ax.set_xticklabels([readable(t) for t in tokens[lo:hi]], rotation=90, fontsize=TICK_PT)
        else:
            ax.set_xlabel("token", fontsize=TICK_PT)
    axes[0, 0].set_title(title + (f" ({n} tokens in {panels} rows)" if panels > 1 else ""), fontsize=10)
    fig.colorbar(im, ax=list(axes[:, 0]), fraction=0.02, pad=0.01)
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
