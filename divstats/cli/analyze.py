"""``kvdiv analyze`` and ``kvdiv split`` (click commands; mapped by kvdiv/cli.py).

Imports only numpy/xarray/scipy/matplotlib-level packages: never torch,
transformers, httpx or gen_service, so analysis runs anywhere.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import click

from divstats.errors import DivstatsError, PlanError
from divstats.plans.format import load_plan, parse_aliases, shipped_plans
from divstats.plans.split import split_disagreement_note, split_table
from protocols import open_traces
from protocols.chunks import cluster_options, dask_client, read_chunks

if TYPE_CHECKING:  # the report room is loaded only when ``kvdiv analyze`` runs (below)
    from divstats.report.analysis import Analysis

__all__ = ["analyze", "split"]

#: What --plan accepts (both commands).
_PLAN_CHOICES = f"a shipped plan's name ({', '.join(shipped_plans())}) or a plan TOML file"


def _fail(message: str) -> None:
    raise click.ClickException(message)


@click.command("analyze")
@click.argument("traces", type=click.Path(exists=True, path_type=Path))
@click.option("--plan", "plan_source", default=None, metavar="NAME|PATH",
              help=f"The prespecified plan: {_PLAN_CHOICES}; its SHA-256 is recorded in every output. "
                   "Without --plan the report is descriptive: every comparison is exploratory.")
@click.option("--out", "out_dir", required=True, type=click.Path(path_type=Path),
              help="Directory for report.html, summary.md and results.nc (built beside it, then renamed "
                   "into place). It must not exist (or be empty) unless --overwrite.")
@click.option("--overwrite", is_flag=True,
              help="Replace an existing --out, but only one that holds nothing except a report kvdiv wrote.")
@click.option("--window", type=click.IntRange(min=0), default=None,
              help="Truncate the observation window to W steps after divergence (default: all observed).")
@click.option("--policy-alias", "aliases", multiple=True, metavar="PLANNED=ACTUAL",
              help="Use data policy ACTUAL where the plan names PLANNED (repeatable). Recorded as a "
                   "deviation; the affected rows are labelled exploratory.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed for every bootstrap and Monte Carlo permutation test.")
@click.option("--n-resamples", type=click.IntRange(min=99), default=9999, show_default=True,
              help="Bootstrap / permutation resamples.")
@click.option("--level", type=click.FloatRange(0.5, 0.999), default=0.95, show_default=True,
              help="Confidence level of the descriptive intervals (plan rows use 1 - alpha).")
@click.option("--cost-ratio", type=click.FloatRange(min=0), default=None, metavar="C",
              help="One draft step / one target step: the speculative-decoding section's speedup "
                   "(reference traces; docs/statistics.md §10).")
@click.option("--no-validate", is_flag=True, help="Skip trace validation on load.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@cluster_options
def analyze(traces: Path, plan_source: str | None, out_dir: Path, overwrite: bool, window: int | None,
            aliases: tuple[str, ...], seed: int, n_resamples: int, level: float, cost_ratio: float | None,
            no_validate: bool, quiet: bool, workers: int | None, scheduler: str | None, chunk_docs: int | None) -> None:
    """Estimate everything, run the plan (if any) on TRACES and write a self-contained report."""
    # Lazy: the report (matplotlib, jinja2) is loaded only when analyze runs, not for ``kvdiv split``.
    from divstats.report.analysis import compute
    from divstats.report.write import check_publishable, publish_report

    try:
        plan = load_plan(plan_source) if plan_source is not None else None
        alias_map = parse_aliases(aliases)
        if plan is None and alias_map:
            raise PlanError("--policy-alias substitutes planned policies; it needs --plan")
        check_publishable(out_dir, overwrite)  # refuse before minutes of computing, not after
        with dask_client(workers, scheduler):  # no cluster unless asked; large files are read chunk by chunk
            ds = open_traces(traces, validate=not no_validate,
                             chunks=read_chunks(traces, workers, scheduler, chunk_docs))
            an = compute(ds, plan, window=window, policy_aliases=alias_map, seed=seed, n_resamples=n_resamples,
                         level=level, progress=not quiet, cost_ratio=cost_ratio)
        paths = publish_report(an, out_dir, overwrite=overwrite)
    except DivstatsError as exc:
        _fail(str(exc))
    except (ValueError, FileNotFoundError, ImportError) as exc:
        _fail(f"{type(exc).__name__}: {exc}")
    _echo_summary(an, paths)


def _echo_summary(an: Analysis, paths: Mapping[str, Path]) -> None:
    """The plan rows (or that there is no plan), notes, deviations and the files written."""
    if an.plan is None:
        click.echo("no plan: descriptive report (every comparison is exploratory)")
    else:
        click.echo(f"plan {an.plan.name} sha256={an.plan.sha256}")
        for r in an.plan_result.table.itertuples(index=False):
            click.echo(f"  {r.id:<24} {r.label:<12} p={r.p_value:.3g} p_adj={r.p_adjusted:.3g} "
                       f"reject={'yes' if r.reject else 'no'} effect={r.effect:.4g}")
    for note in an.notes:
        click.echo(f"note: {note}", err=True)
    for dev in (an.plan_result.deviations if an.plan_result is not None else []):
        click.echo(f"deviation: {dev}", err=True)
    for path in paths.values():
        click.echo(f"wrote {path}")


def _doc_ids(path: Path) -> tuple[list[str], list[str] | None, str]:
    """(doc ids, the file's own split labels or None, what the file is)."""
    if path.suffix in (".jsonl", ".ndjson"):
        ids, labels = [], []
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    _fail(f"{path}:{lineno}: not JSON: {exc}")
                key = next((k for k in ("id", "doc_id", "doc") if k in obj), None)
                if key is None:
                    _fail(f"{path}:{lineno}: no 'id' (or 'doc_id') field")
                ids.append(str(obj[key]))
                labels.append(str(obj.get("split", "")))
        return ids, labels, "documents"
    ds = open_traces(path, validate=False)
    labels = [str(s) for s in ds["split"].values] if "split" in ds.coords else None
    return [str(d) for d in ds["doc"].values], labels, "traces"


@click.command("split")
@click.argument("source", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--plan", "plan_source", required=True, metavar="NAME|PATH",
              help=f"Plan whose salt and confirmatory fraction define the split: {_PLAN_CHOICES}.")
@click.option("--format", "fmt", type=click.Choice(["table", "jsonl", "csv"]), default="table", show_default=True)
@click.option("--strict", is_flag=True, help="Exit with status 1 if the file's split labels disagree with the plan.")
def split(source: Path, plan_source: str, fmt: str, strict: bool) -> None:
    """Show the plan's exploratory/confirmatory split for SOURCE (traces .nc/.zarr or documents .jsonl).

    The split is sha256(salt + ":" + doc_id) read as a number in [0, 1): confirmatory
    below the plan's confirmatory_fraction. It is authoritative; a file's own
    split labels that disagree are reported.
    """
    try:
        plan = load_plan(plan_source)
    except PlanError as exc:
        _fail(str(exc))
    try:
        ids, labels, what = _doc_ids(source)
    except (OSError, ValueError, KeyError, RecursionError) as exc:  # damaged, foreign or not UTF-8
        _fail(f"{source}: cannot read document ids ({type(exc).__name__}: {exc})")
    table = split_table(ids, plan, labels)
    if fmt == "jsonl":
        for r in table.itertuples(index=False):
            click.echo(json.dumps({"doc": r.doc, "split": r.split, "file_split": r.dataset_split,
                                   "agrees": bool(r.agrees)}))
    elif fmt == "csv":
        click.echo(table.to_csv(index=False), nl=False)
    else:
        width = max([len(i) for i in ids] + [3])
        click.echo(f"{'doc':<{width}}  split         file label")
        for r in table.itertuples(index=False):
            flag = "" if r.agrees else "  <- disagrees"
            click.echo(f"{r.doc:<{width}}  {r.split:<12}  {r.dataset_split or '-'}{flag}")
    counts = table["split"].value_counts().to_dict()
    click.echo(f"plan {plan.name} (salt {plan.salt!r}, confirmatory fraction {plan.confirmatory_fraction}): "
               f"{len(table)} {what}: {counts.get('confirmatory', 0)} confirmatory, "
               f"{counts.get('exploratory', 0)} exploratory", err=True)
    note = split_disagreement_note(table)
    if note:
        click.echo(f"note: {note}", err=True)
        if strict:
            sys.exit(1)
