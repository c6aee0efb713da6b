"""``kvdiv demo``, ``kvdiv docs`` and ``kvdiv collect``: the application layer's commands.

``demo`` runs the study end to end (the one command that joins every package);
``docs`` builds a document set counted with a model's tokenizer; ``collect`` is the
collector's command plus the adaptive options (``--target-se``, ``--budget``), whose
rounds need ``divstats`` (``kvdiv.adaptive``).

The heavy imports (the server, divstats) happen inside the command, so that
``kvdiv demo --help`` stays instant.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from collector.cli import collect as collector_collect
from collector.tasks import TASKS
from kvdiv.demo_spec import DEFAULT_MODELS as _DEMO_MODELS
from kvdiv.demo_spec import DEFAULT_REPLICATES, MODEL_REPLICATES, DemoConfig

if TYPE_CHECKING:
    from kvdiv.adaptive import AdaptiveSpec

_DEMO = DemoConfig()  # the demo's defaults, shown in its --help


@click.command("docs")
@click.option("--source", default="pydoc", show_default=True,
              help="'pydoc' (CPython's built-in language reference), a JSONL file (id, text) "
                   "or a folder of .txt files.")
@click.option("-o", "--out", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="JSONL file to write.")
@click.option("--target-tokens", default=256, show_default=True, type=click.IntRange(min=8),
              help="Chunk length to aim for (pydoc, or user documents with --chunk).")
@click.option("--count", type=click.IntRange(min=1), default=None,
              help="Keep this many documents (a deterministic spread over topics). Default: all.")
@click.option("--chunk/--no-chunk", default=False, show_default=True,
              help="Cut user documents at paragraph boundaries like the built-in set.")
@click.option("--tokenizer", "tokenizer_id", default="embedded", show_default=True,
              help="Count tokens with this model's tokenizer (a `kvdiv serve --model` id), or 'approx'.")
@click.option("--server", default=None, metavar="URL",
              help="Count tokens with this running server's POST /tokenize instead (no torch needed).")
@click.option("--api-key", default=None, envvar="KVDIV_API_KEY", help="Bearer token for --server.")
@click.option("--force", is_flag=True, help="Replace --out if it exists.")
@click.option("--task", type=click.Choice(list(TASKS)), default=None,
              help="Write RULER-style synthetic task documents instead (answers, scorer, needle depths spread "
                   "evenly; --count of them, default 30), the haystack from --source's text.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds --task's needles and haystack.")
def docs(source: str, out: Path, target_tokens: int, count: int | None, chunk: bool, tokenizer_id: str,
         server: str | None, api_key: str | None, force: bool, task: str | None, seed: int) -> None:
    """Build a JSONL document set (id, text, source, n_tokens, ...), or a task's documents (--task)."""
    from collector import documents as D

    # A document set may be hand-curated; refuse before the (slow) tokenizer loads.
    if out.exists() and not force:
        raise click.ClickException(f"{out} exists; pass --force to replace it")

    if server is not None:
        tokenizer = D.server_token_counter(server, api_key)
    else:
        from kvdiv.demo_documents import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_id)
    try:
        if task is not None:
            items = _task_documents(task, source, tokenizer, target_tokens, 30 if count is None else count, seed)
        else:
            items = D.load_source(source, tokenizer, target_tokens=target_tokens, chunk=chunk)
            items = D.select(items, count)
        D.write_jsonl(items, out)
    except OSError as exc:
        raise click.ClickException(f"{exc.filename or out}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    for line in D.iter_summary(items):
        click.echo(line, err=True)
    click.echo(str(out))


def _task_documents(task: str, source: str, tokenizer: object, target_tokens: int, count: int,
                    seed: int) -> list:
    """``kvdiv docs --task``: the task's documents, the haystack from pydoc or the user's text."""
    from collector import documents as D
    from collector.tasks import haystack_sentences, task_documents

    if source == "pydoc":
        texts = None
    elif Path(source).is_file() and Path(source).suffix.lower() != ".jsonl":   # plain text
        texts = [Path(source).read_text(encoding="utf-8")]
    else:
        texts = [d.text for d in D.load_source(source, None)]
    return task_documents(task, count, target_tokens=target_tokens, tokenizer=tokenizer, seed=seed,
                          haystack=haystack_sentences(texts), source="pydoc_data.topics" if texts is None else source)


@click.command("demo")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("runs/demo"), show_default=True)
@click.option("--docs-count", type=click.IntRange(min=2), default=None,
              help=f"Documents to collect.  [default: {_DEMO.docs_count}]")
@click.option("--replicates", "-R", type=click.IntRange(min=1), default=None,
              help="Replicates per request, for every model.  [default: each model's own: "
                   + ", ".join(f"{r} for {m}" for m, r in MODEL_REPLICATES.items()) + f", else {DEFAULT_REPLICATES}]")
@click.option("--max-new-tokens", "-T", type=click.IntRange(min=2), default=None,
              help=f"Horizon T.  [default: {_DEMO.max_new_tokens}]")
@click.option("--window", "-W", type=click.IntRange(min=1), default=None,
              help=f"Residual observation window W.  [default: {_DEMO.window}]")
@click.option("--target-tokens", type=click.IntRange(min=16), default=None,
              help=f"Document length in tokens.  [default: {_DEMO.target_tokens}]")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--server", "servers", multiple=True,
              help="Use these running servers instead of starting one (e.g. a GPU box).")
@click.option("--models", default=",".join(_DEMO_MODELS), show_default=True,
              help="The models studied, comma-separated, one server each in turn (the embedded models: "
                   "smollm2-135m, gemma3-270m; any `kvdiv serve --model` id); one model with --server.")
@click.option("--model", default=None, hidden=True, help="One model: the same as --models MODEL.")
@click.option("--concurrency", type=click.IntRange(min=1), default=None,
              help=f"Requests in flight per server.  [default: {_DEMO.concurrency}]")
@click.option("--api-key", default=None, envvar="KVDIV_API_KEY")
@click.option("--plan", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Run this plan as written (snapkv#512 substituted post hoc) instead of the derived demo plan.")
@click.option("--control/--no-control", default=_DEMO.control, show_default=True,
              help="Collect the numerical control (`full` as a candidate) and report the noise floor.")
@click.option("--reference-docs", type=click.IntRange(min=0), default=None,
              help="Documents of the small reference set (speculative decoding; 0 skips it).  "
                   f"[default: {_DEMO.reference_docs}]")
@click.option("--passkey-docs", type=click.IntRange(min=0), default=None,
              help="Pass-key documents of the answers set (SmolLM2, greedy: does compression change the answer?; "
                   f"0 skips it).  [default: {_DEMO.passkey_docs}]")
def demo(out: Path, docs_count: int | None, replicates: int | None, max_new_tokens: int | None,
         window: int | None, target_tokens: int | None, seed: int, servers: tuple[str, ...], models: str,
         model: str | None,
         concurrency: int | None, api_key: str | None, plan: Path | None, control: bool,
         reference_docs: int | None, passkey_docs: int | None) -> None:
    """The paper's study end to end: documents, server, traces, plan, report."""
    from kvdiv.demo import run_demo
    from kvdiv.demo_spec import DemoError

    overrides = {k: v for k, v in dict(docs_count=docs_count, replicates=replicates, max_new_tokens=max_new_tokens,
                                       window=window, target_tokens=target_tokens,
                                       concurrency=concurrency, reference_docs=reference_docs,
                                       passkey_docs=passkey_docs).items()
                 if v is not None}
    chosen = [model] if model else [m.strip() for m in models.split(",") if m.strip()]
    if not chosen or len(set(chosen)) != len(chosen):
        raise click.BadParameter(f"give distinct model ids, not {models!r}", param_hint="--models")
    cfg = DemoConfig(out=out, seed=seed, servers=list(servers), models=chosen, api_key=api_key, plan=plan,
                     control=control, **overrides)
    try:
        run_demo(cfg)
    except DemoError as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        click.echo(f"\ninterrupted; rerun `kvdiv demo` with the same options to resume ({out} keeps "
                   "every complete request)", err=True)
        sys.exit(130)


ADAPTIVE_OPTIONS = [
    click.Option(["--target-se"], default=None, metavar="X|METRIC=X,...",
                 help="Adaptive: after the pilot (-R replicates per pair), add rounds of replicates until every "
                      "(document, policy)'s Monte Carlo SE reaches X on the target metrics (one X per metric when "
                      "there are several). The estimate uses the rounds after the pilot (docs/design.md)."),
    click.Option(["--budget"], type=float, default=None,
                 help="Adaptive: spend this many further replicates (or --budget-unit cost) after the pilot, "
                      "where they cut the metrics' variance most (Neyman allocation), in one round."),
    click.Option(["--budget-unit"], type=click.Choice(["replicates", "cost"]), default="replicates",
                 show_default=True, help="cost: the pilot's cost model (seconds when the traces record them, "
                                         "else decoding steps) per replicate."),
    click.Option(["--plan", "plan_source"], default=None, metavar="NAME|PATH",
                 help="Adaptive: target the metrics of this plan's hypotheses.  [default: paper]"),
    click.Option(["--metrics"], default=None, help="Adaptive: target these metrics (comma-separated) instead."),
    click.Option(["--max-rounds"], type=click.IntRange(min=1), default=1, show_default=True,
                 help="Adaptive: rounds after the pilot, at most (--target-se). One keeps the estimate exactly "
                      "unbiased; more leave a small bias (docs/design.md). May be raised on a rerun."),
    click.Option(["--allocate-by"], type=click.Choice(["cell", "policy"]), default="cell", show_default=True,
                 help="Adaptive: allocate from each pair's own variance, or its policy's mean over documents."),
]
_ADAPTIVE_NAMES = {o.name for o in ADAPTIVE_OPTIONS}


def _collect(**options: object) -> None:
    adaptive = {k: options.pop(k) for k in _ADAPTIVE_NAMES}
    if adaptive["target_se"] is None and adaptive["budget"] is None:
        given = [f"--{k.replace('_', '-')}" for k in ("plan_source", "metrics") if adaptive[k] is not None]
        if given:
            raise click.UsageError(f"{', '.join(given)} apply to an adaptive collection: add --target-se or --budget")
        return collector_collect.callback(**options)  # a plain collection, exactly as `collector.cli`
    _collect_adaptive(options, adaptive)


def _collect_adaptive(options: dict[str, object], adaptive: dict[str, object]) -> None:
    from collector.cli import collect_config
    from collector.errors import CollectorError
    from kvdiv.adaptive import collect_adaptive

    out = options["out"]
    try:
        spec = _spec(adaptive)
        result = collect_adaptive(collect_config(**options), spec)
    except CollectorError as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        raise click.ClickException(f"{exc.filename or out}: {exc.strerror or exc}") from None
    for k, res in sorted(result.results.items()):
        click.echo(f"round {k}: {res.summary()}", err=True)
    click.echo(f"stopped: {result.stopped}", err=True)
    if not result.ok:
        click.echo(f"Rerun the same command to resume; {out} keeps every complete request.", err=True)
        sys.exit(1)
    click.echo(f"complete: `kvdiv pack {out} -o {Path(str(out)) / 'traces.nc'}` (estimates use the rounds after "
               "the pilot)", err=True)


def _spec(adaptive: dict[str, object]) -> AdaptiveSpec:
    """The AdaptiveSpec of the command's options: metrics from --metrics or the plan."""
    from collector.errors import ConfigError
    from kvdiv.adaptive import AdaptiveSpec, parse_target, plan_metrics

    if adaptive["target_se"] is not None and adaptive["budget"] is not None:
        raise ConfigError("--target-se and --budget both given: choose one (a target SE, or a budget to spend)")
    plan = None
    if adaptive["metrics"]:
        metrics = tuple(m.strip() for m in str(adaptive["metrics"]).split(",") if m.strip())
    else:
        metrics, skipped, plan = plan_metrics(adaptive["plan_source"] or "paper")
        if skipped:
            click.echo(f"not targeted (no per-document Monte Carlo variance): {', '.join(skipped)}", err=True)
    target = parse_target(str(adaptive["target_se"]), metrics) if adaptive["target_se"] is not None else None
    return AdaptiveSpec(metrics, target_se=target, budget=adaptive["budget"], budget_unit=str(adaptive["budget_unit"]),
                    by=str(adaptive["allocate_by"]), max_rounds=int(adaptive["max_rounds"]), plan=plan)


collect = click.Command(
    "collect", callback=_collect, params=[*collector_collect.params, *ADAPTIVE_OPTIONS],
    help=(collector_collect.help or "") + "\n\nWith --target-se or --budget the run is adaptive: -R replicates "
         "per pair are a pilot, then rounds of further replicates go where they pay (docs/design.md); "
         "`kvdiv pack` stacks the rounds along replicate and the analysis uses the rounds after the pilot.",
    short_help=collector_collect.short_help)

__all__ = ["collect", "demo", "docs"]
