"""The per-layer results table as people read it: one formatting for the CLI and the report.

It leads with what decides the verdict: the tilt Δγ on the verdict's tokens with its interval over
sequences, the band its null (directions drawn from the stream's own covariance) puts Δγ in, the BH q
and the verdict; then static alignment (γ pre against the same null) and its verdict; then rho with
its interval and the Haar null's band, and the tilt's percentile among F's own eigen-subspaces.
P-values never print as 0: a Monte-Carlo p at its floor prints as "<=floor", any other small p in
scientific notation. Effects print with the significant digits their size needs (``fmt_sig``).
"""

from __future__ import annotations

import io
import math

from ..monitor.summary import head_rows


def fmt_num(v, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:.1e}" if (0 < abs(v) < 10**-digits) else f"{v:.{digits}f}"
    return str(v)


def fmt_p(p, draws: int | None = None) -> str:
    """A p-value, never '0.000': '<=floor' at the Monte-Carlo floor 2/(K+1), else 2 significant digits."""
    if p is None or (isinstance(p, float) and math.isnan(p)):
        return "–"
    p = float(p)
    if draws:
        floor = 2.0 / (int(draws) + 1)
        if p <= floor * (1 + 1e-9):
            return f"≤{floor:.2g}"
    if p == 0.0:
        return "<1e-300"
    return f"{p:.2g}" if p >= 1e-3 else f"{p:.1e}"


def fmt_sig(v, digits: int = 2, sign: bool = True) -> str:
    """A number with ``digits`` significant digits, never '0.000' for a small one: 0.024, -0.0033, 1.2e-05."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    v = float(v)
    if v == 0 or not math.isfinite(v):
        return f"{v:g}"
    mag = math.floor(math.log10(abs(v)))
    plus = "+" if sign else ""
    if mag < -4 or mag >= 4:
        return f"{v:{plus}.{digits - 1}e}"
    return f"{v:{plus}.{max(digits - 1 - mag, 0)}f}"


def _tilt(r) -> str:
    """The tilt Δγ on the verdict's tokens and its 95% interval over sequences."""
    t = r.get("tilt", math.nan)
    if t is None or math.isnan(t):
        return "–"
    lo, hi = r.get("tilt_ci_lo", math.nan), r.get("tilt_ci_hi", math.nan)
    return f"{fmt_sig(t)} [{fmt_sig(lo)}, {fmt_sig(hi)}]"


def _band(lo_col: str, hi_col: str, sign: bool = True):
    def cell(r) -> str:
        lo, hi = r.get(lo_col, math.nan), r.get(hi_col, math.nan)
        return "–" if lo is None or math.isnan(lo) else f"{fmt_sig(lo, sign=sign)}…{fmt_sig(hi, sign=sign)}"

    return cell


def _static(r) -> str:
    """γ pre on the verdict's tokens and its static verdict, short."""
    g = r.get("static", math.nan)
    if g is None or math.isnan(g):
        return "–"
    v = str(r.get("verdict_static", ""))
    mark = {"toward": " above", "away": " below"}.get(v, "")
    return f"{fmt_sig(g, sign=False)}{mark}"


def _ci(r) -> str:
    if math.isnan(r.get("rho", math.nan)):
        return "–"
    lo, hi = r.get("rho_ci_lo", math.nan), r.get("rho_ci_hi", math.nan)
    band = "" if math.isnan(lo) else f" [{lo:.2f}, {hi:.2f}]"
    return f"{r['rho']:.3f}{band}"


def fmt_band(r) -> str:
    """The null's band and, when the null saw fewer tokens than rho (null_stride > 1), in brackets the
    target's rho on the null's tokens: the figure the band, pct, p and the verdict compare."""
    lo, hi = r.get("null_rho_lo", math.nan), r.get("null_rho_hi", math.nan)
    if math.isnan(lo):
        return "–"
    tested = r.get("rho_null_tokens", math.nan)
    fewer = r.get("null_tokens", 0) < r.get("n_tokens", 0) and not math.isnan(tested)
    return f"{lo:.2f}–{hi:.2f}" + (f" ({tested:.2f})" if fewer else "")


def _rank(r) -> str:
    v = r.get("eig_rank", math.nan)
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else str(int(v))


# (header, cell function of a summary row as a dict)
RUN_COLUMNS = (
    ("layer", lambda r: str(int(r["layer"]))),
    ("target", lambda r: str(r["target"])),
    ("Δγ [95% CI]", _tilt),  # the tested number: the tilt on the verdict's tokens, interval over sequences
    ("null Δγ 95%", _band("tilt_null_lo", "tilt_null_hi")),  # directions drawn from the stream's covariance
    ("q", lambda r: fmt_p(r.get("q_tilt"))),
    ("verdict", lambda r: fmt_verdict(r)),
    ("γ pre (static)", _static),  # static alignment against the same null: above / below it at q < 0.05
    ("eig pct", lambda r: fmt_num(r.get("eig_tilt_percentile"), 2)),  # Δγ's percentile among F's own subspaces
    ("ρ [95% CI]", _ci),
    ("null ρ 95% (ρ there)", fmt_band),  # the Haar null's band, on the null's tokens
    ("kind", lambda r: str(r["kind"])),  # DESIGN's names, as the API and the report spell them
    ("|λ1|", lambda r: fmt_num(r["abs_lambda_1"])),
)


# what a narrow terminal gives up first, last one last; layer, target, Δγ and the verdict always stay
DROP_ORDER = ("|λ1|", "kind", "null ρ 95% (ρ there)", "ρ [95% CI]", "eig pct", "γ pre (static)", "null Δγ 95%", "q")
FULL_WIDTH = 160  # at this width or more, and when piped, every column


def fmt_verdict(r) -> str:
    """The verdict; 'too few sequences' with the count of the scoring half and the minimum it needs; 'no mid
    reading' with what Δγ needs."""
    from ..monitor.stats import MIN_NULL_TOKENS, NO_MID, TOO_FEW
    from ..monitor.verdict import MIN_SEQUENCES, TOO_FEW_SEQ

    v = str(r["verdict"])
    if v == NO_MID:
        return f"{v} (Δγ needs 'mid')"
    if v == TOO_FEW_SEQ:
        n = r.get("verdict_sequences", 0)
        return f"{v} ({int(n) if n == n else 0} < {MIN_SEQUENCES})"
    return f"{v} ({int(r['null_tokens'])} < {MIN_NULL_TOKENS})" if v == TOO_FEW else v


def rows(summary, columns=RUN_COLUMNS) -> tuple[list[str], list[list[str]]]:
    """(headers, cells) of a summary DataFrame."""
    heads = [h for h, _ in columns]
    cells = [[fn(r) for _, fn in columns] for r in summary.to_dict("records")]
    return heads, cells


def _head_cell(r) -> str:
    """One head's ρ, marked + (toward) or − (away) when its verdict says so."""
    mark = {"toward": "+", "away": "−"}.get(str(r["verdict"]), "")
    return "–" if math.isnan(r["rho"]) else f"{r['rho']:.2f}{mark}"


def head_table(summary) -> tuple[list[str], list[list[str]]]:
    """The head targets compactly: one row per (layer, head target), ρ of each head in turn (+ toward,
    − away at q_tilt < 0.05) and the verdicts counted; every column is in summary.csv."""
    heads = head_rows(summary)
    cells = []
    for (layer, name), g in heads.groupby(["layer", heads["target"].str.rsplit("/", n=1).str[0]], sort=True):
        g = g.sort_values("head")
        counts = g["verdict"].value_counts()
        said = ", ".join(f"{int(counts[v])} {v}" for v in counts.index)
        cells.append([str(int(layer)), str(name), " ".join(_head_cell(r) for r in g.to_dict("records")), said])
    return ["layer", "target", "ρ of heads 0, 1, ... (+ toward, − away)", "verdicts"], cells


def json_safe(x):
    """x with every non-finite float replaced by None, so json.dumps writes valid JSON (null, not NaN)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    return x


# ---- the CLI's output helper: one place prints tables and JSON ----


def fmt_complex(z: complex, digits: int = 4) -> str:
    if abs(z.imag) < 1e-12:
        return f"{z.real:.{digits}f}"
    return f"{z.real:.{digits}f}{z.imag:+.{digits}f}i"


def emit(
    title: str,
    columns: list[str],
    rows: list[list],
    as_json: bool,
    records: list[dict],
    wrap: tuple[str, ...] = (),
    drop: tuple[str, ...] = (),
    console=None,
    caption: str | None = None,
) -> None:
    """Print rows as a table for people (``print_table``, ``caption`` under it), or ``records`` as JSON for
    programs (NaN as null). User text in a title or cell is printed as it is, never read as rich markup."""
    import json

    import typer

    if as_json:
        typer.echo(json.dumps(json_safe(records), indent=2, allow_nan=False))  # NaN -> null: valid JSON
        return
    cells = [[str(x) for x in r] for r in rows]
    print_table(title, columns, cells, wrap=wrap, drop=drop, console=console, caption=caption)


LEFT_COLUMNS = ("kind", "rank", "name", "path", "target", "verdict", "check", "dtype", "before", "after")


def fit_table(
    title: str, columns: list[str], cells: list[list[str]], width: int | None, wrap=(), drop=(), caption=None
):
    """A rich Table of ``cells`` that a terminal ``width`` columns wide shows without cutting a cell.

    Every column keeps its widest cell and its header whole, except those in ``wrap`` (token lists), which
    wrap at spaces; when even that is too wide, the columns of ``drop`` go, in that order, and the caption
    names them. ``width`` None (piped): every column at its natural width. Returns (table, dropped, the table's
    rich Measurement).
    """
    from rich.cells import cell_len
    from rich.console import Console

    def build(keep: list[int], caption: str | None, wrapping: bool, squeeze: int = 0, rows=cells):
        from rich.table import Table
        from rich.text import Text

        table = Table(title=Text(title), caption=caption, header_style="bold", collapse_padding=True)
        for i in keep:
            c = columns[i]
            whole = max([len(c)] + [len(r[i]) for r in cells])
            soft = wrapping and c in wrap
            word = max(cell_len(w) for x in [c] + [r[i] for r in cells] for w in x.split() or [""])
            table.add_column(
                Text(c), justify="left" if c in LEFT_COLUMNS or c in wrap else "right",
                no_wrap=not soft, overflow="fold", min_width=None if soft else whole,
                width=max(8, word - squeeze) if soft and squeeze else None,  # a token longer than the room: folded
            )  # fmt: skip
        for r in rows:
            table.add_row(*[Text(r[i]) for i in keep])  # Text: a token or a name is never read as markup
        return table

    measure = Console(width=10_000, file=io.StringIO())
    telling = _telling_rows(cells, len(columns))

    def needs(keep: list[int], caption: str | None, wrapping: bool = True, squeeze: int = 0):
        return measure.measure(build(keep, caption, wrapping, squeeze, telling))

    keep = list(range(len(columns)))
    if width is None or needs(keep, caption, False).maximum <= width:
        return build(keep, caption, False), [], needs(keep, caption, False)
    dropped: list[str] = []
    for c in drop:
        if needs(keep, caption if not dropped else None).minimum <= width:
            break
        dropped.append(c)
        keep = [i for i, x in enumerate(columns) if x not in dropped]
    if dropped:
        said = f"{len(dropped)} more columns ({', '.join(dropped)}): --json, or a wider terminal"
        caption = f"{caption}; {said}" if caption else said
    excess = needs(keep, caption).minimum - width
    squeeze = excess if excess > 0 and any(columns[i] in wrap for i in keep) else 0  # a token too wide folds
    return build(keep, caption, True, squeeze), dropped, needs(keep, caption, True, squeeze)


def _telling_rows(cells: list[list[str]], n_columns: int) -> list[list[str]]:
    """The rows that measure as all of ``cells`` do: rich measures a column as the most its cells need, a cell's
    longest line (its widest) and its longest word (its narrowest, where it wraps). Measuring 360 head rows at
    each fitting step took 4.9 s of `spectrum --heads` on SmolLM2; these are at most 2 a column."""
    from rich.cells import cell_len

    def line(x: str) -> int:
        return max((cell_len(w) for w in x.splitlines()), default=0)

    def word(x: str) -> int:
        return max((cell_len(w) for w in x.split()), default=0)

    rows = range(len(cells))
    found = {max(rows, key=lambda j: f(cells[j][i])) for i in range(n_columns) for f in (line, word)} if cells else ()
    return [cells[j] for j in sorted(found)]


def print_table(
    title: str, columns: list[str], cells: list[list[str]], wrap=(), drop=(), console=None, caption=None
) -> None:
    """Print a table: on a terminal, fitted to its width (``fit_table``: nothing cut, token lists wrapped,
    whole columns dropped and named last); piped, every column at its natural width, as long as the rows are."""
    import sys

    from rich.console import Console

    console = console or Console()
    table, _, need = fit_table(
        title, columns, cells, console.width if console.is_terminal else None, wrap, drop, caption
    )
    width = need.maximum if not console.is_terminal else max(console.width, need.minimum)
    if width != console.width:  # piped, or too wide to fit: whole rows, never a cut number
        console = Console(width=width, file=console.file or sys.stdout, force_terminal=console.is_terminal)
    console.print(table)


def _rich_table(title: str, heads: list[str], cells: list[list[str]], caption: str | None = None):
    from rich.table import Table
    from rich.text import Text

    # collapsed padding: the full table of a 30-layer model fits 160 columns with the long kind names
    table = Table(title=Text(title), caption=caption, header_style="bold", collapse_padding=True)
    for c in heads:
        table.add_column(Text(c), justify="left" if c in ("kind", "target", "verdict") else "right", no_wrap=True)
    for r in cells:
        table.add_row(*[Text(x) for x in r])  # Text: a custom target's name is never read as markup
    return table


def run_table(title: str, summary, width: int, wide: bool = False):
    """The run table as a rich Table for a terminal ``width`` columns wide, and the headers it left out.

    Every column when ``wide`` or when they fit; else the columns of ``DROP_ORDER`` go, in that order,
    until the rest fits, so no number is ever cut to '0…'; the caption names what went and where it is.
    """
    from rich.console import Console

    heads, cells = rows(summary)
    console = Console(width=10_000, file=io.StringIO())  # measures a row's natural width, uncut
    dropped: list[str] = []
    table = _rich_table(title, heads, cells)
    for h in () if wide else DROP_ORDER:
        if console.measure(table).maximum <= width:
            break
        dropped.append(h)
        keep = [i for i, x in enumerate(heads) if x not in dropped]
        table = _rich_table(title, [heads[i] for i in keep], [[r[i] for i in keep] for r in cells])
    if dropped:
        caption = f"{len(dropped)} more columns ({', '.join(dropped)}): --wide, or summary.csv"
        keep = [i for i, x in enumerate(heads) if x not in dropped]
        table = _rich_table(title, [heads[i] for i in keep], [[r[i] for i in keep] for r in cells], caption)
    return table, dropped


def print_run_table(title: str, summary, wide: bool = False, console=None) -> None:
    """Print the run table: compact on a terminal narrower than it (``--wide``: every column, the
    lines then wrap), every column at ``FULL_WIDTH`` or more and when piped."""
    from rich.console import Console

    console = console or Console()  # a terminal's width; piped (not a terminal): every column, below
    table, _ = run_table(title, summary, console.width, wide=wide or not console.is_terminal)
    width = Console(width=10_000, file=io.StringIO()).measure(table).maximum
    if width > console.width:  # --wide or piped: whole rows, never a cut number
        console = Console(width=width, file=console.file, force_terminal=console.is_terminal)
    console.print(table)


def print_head_table(title: str, summary, console=None) -> None:
    """Print ``head_table`` (nothing when the summary has no head targets)."""
    heads, cells = head_table(summary)
    if not cells:
        return
    n = len(head_rows(summary))
    caption = f"{n} head rows: every column (Δγ, its interval and null band, q_tilt ...) in summary.csv, column head"
    print_table(title, heads, cells, wrap=(heads[2],), console=console, caption=caption)


def fmt_mb(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


def steered_where(n_prompts: int) -> str:
    """Where the steer command reads its probabilities."""
    return (
        f"mean over the {n_prompts} prompts, each at its last token" if n_prompts > 1 else "at the prompt's last token"
    )


def print_steered(model: str, strength: str, prompts: list[str], tok, before, after, top_k: int, target) -> None:
    """The steer command's prompts, one a line (inside the title one wrapped), then its table: ``steered_rows``
    of the next-token probabilities ``before`` and ``after`` (prompts, vocab) averaged over the prompts, saying
    under it why its rows are in their order and where its probabilities are read."""
    import typer

    rows = steered_rows(tok, before.mean(0), after.mean(0), top_k, target)
    several = len(prompts) > 1
    said = [f"prompts ({len(prompts)}):"] + [f"  {p!r}" for p in prompts] if several else [f"prompt: {prompts[0]!r}"]
    typer.echo("\n".join(said))
    whose = "prompts'" if several else "prompt's"
    title = f"{model}: the {whose} next token, steered at {strength}"
    order = f"rows: the top {top_k} before and after, and --toward; most probable after steering first"
    caption = f"{order}; p: {steered_where(len(prompts))}"
    emit(title, ["next token", "p before", "p after", "change"], rows, False, [], wrap=("next token",), caption=caption)


def steered_rows(tok, before, after, top_k: int, target: int | None) -> list[list[str]]:
    """One row per token in the top-k before or after, and the --toward token: its probability before and
    after, most probable after first; the --toward token marked."""
    ids = [int(i) for i in before.topk(top_k).indices] + [int(i) for i in after.topk(top_k).indices]
    ids = sorted(set(ids + ([target] if target is not None else [])), key=lambda i: -float(after[i]))
    rows = []
    for i in ids:
        name = repr(tok.decode([i])) + ("  (--toward)" if i == target else "")
        pb, pa = float(before[i]), float(after[i])
        rows.append([name, f"{pb:.3f}", f"{pa:.3f}", f"{pa - pb:+.3f}"])
    return rows
