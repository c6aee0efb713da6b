"""``kvdiv power``: how much a plan's hypotheses can show at a study size, from pilot traces.

Mapped by kvdiv/cli.py; imports only divstats and protocols (never torch).
"""

from __future__ import annotations

import math
from pathlib import Path

import click

from divstats.design.allocation import design
from divstats.design.certify_power import certify_power
from divstats.design.power import power
from divstats.errors import DivstatsError
from divstats.plans.format import load_plan, parse_aliases, shipped_plans
from protocols import open_traces

__all__ = ["power_command"]


def _fmt(x: float, digits: int = 3) -> str:
    return "nan" if x is None or not math.isfinite(x) else f"{x:.{digits}g}"


def format_power_table(table) -> list[str]:
    """The power table as aligned text lines (one per hypothesis and design)."""
    cw = max([10, *(len(f"{a} - {b}") for a, b in zip(table["a"], table["b"], strict=True))])
    iw = max([10, *(len(str(i)) for i in table["id"])])
    tw = max([16, *(len(f"{t} {d}") for t, d in zip(table["test"], table["direction"], strict=True))])
    head = (f"{'hypothesis':<{iw}} {'metric':<11} {'comparison':<{cw}} {'test':<{tw}} {'alpha':>7} {'docs':>6} "
            f"{'R':>4} {'n':>5} {'effect':>9} {'sd_doc':>8} {'sd_rep':>8}  power [range]")
    lines = [head, "-" * len(head)]
    for r in table.itertuples(index=False):
        comparison = f"{r.a} - {r.b}"
        power = (f"{_fmt(r.power, 2):>5} [{_fmt(r.power_low, 2)}, {_fmt(r.power_high, 2)}]"
                 if math.isfinite(r.power) else "  n/a")
        lines.append(f"{r.id:<{iw}} {r.metric:<11} {comparison:<{cw}} {r.test + ' ' + r.direction:<{tw}} "
                     f"{r.alpha_used:>7.4f} {r.docs:>6d} {r.replicates:>4d} {r.n_docs:>5d} {_fmt(r.effect):>9} "
                     f"{_fmt(r.sd_between):>8} {_fmt(r.sd_replicate):>8}  {power}")
    return lines


def row_notes(table, shown: list[str]) -> list[str]:
    """The rows' own notes (e.g. a test refused at that many documents), once per (note, hypothesis)."""
    lines: dict[str, list[str]] = {}
    for r in table.itertuples(index=False):
        for note in filter(None, str(r.note or "").split("; ")):
            if note not in shown:
                lines.setdefault(note, [])
                if r.id not in lines[note]:
                    lines[note].append(r.id)
    return [f"note ({', '.join(ids)}): {note}" for note, ids in lines.items()]


def format_design_table(table, target: float) -> list[str]:
    """Documents needed per hypothesis (rows) and replicates per document (columns)."""
    grid = table.pivot(index="id", columns="replicates", values="docs").reindex(table["id"].unique())
    head = f"{'documents for power ' + format(target, 'g'):<26}" + "".join(f"{'R=' + str(r):>8}" for r in grid.columns)
    lines = [head]
    for hid, row in grid.iterrows():
        lines.append(f"{hid:<26}" + "".join(f"{'-' if not math.isfinite(v) else int(v):>8}" for v in row))
    return lines


def format_certify_power(table, target: float) -> list[str]:
    """Per [[certify]] and budget: the pilot's difference, power by study size, and the documents needed."""
    lines: list[str] = []
    sizes = sorted(table["docs"].unique())
    for (cid, model), rows in table.groupby(["id", "model"], sort=False, dropna=False):
        where = f"certify {cid}" + ("" if model is None or model != model else f" [{model}]")
        lines.append(f"{where}: power to certify each budget (fixed sequence, margin {rows['margin'].iloc[0]:g})")
        head = f"  {'budget':<22} {'kept':>6} {'pilot diff':>10} " + "".join(f"{'N=' + str(n):>8}" for n in sizes) + \
            f"  documents for power {target:g}"
        lines.append(head)
        for budget, b in rows.groupby("budget", sort=False):
            needed = b["docs_needed"].iloc[0]
            lines.append(f"  {budget:<22} {_fmt(b['kept'].iloc[0]):>6} {_fmt(b['pilot_difference'].iloc[0]):>10} "
                         + "".join(f"{_fmt(p, 2):>8}" for p in b["power"])
                         + f"  {'more than ' + str(max(sizes)) if not math.isfinite(needed) else int(needed)}"
                         + (f"  ({b['note'].iloc[0]})" if b["note"].iloc[0] else ""))
    return lines


@click.command("power")
@click.argument("traces", type=click.Path(exists=True, path_type=Path))
@click.option("--plan", "plan_source", required=True, metavar="NAME|PATH",
              help=f"A shipped plan's name ({', '.join(shipped_plans())}) or a plan TOML file.")
@click.option("--docs", multiple=True, type=click.IntRange(min=2),
              help="Documents in the study (repeatable; default: the pilot's). A confirmatory hypothesis "
                   "uses the plan's confirmatory fraction of them.")
@click.option("--replicates", "-R", multiple=True, type=click.IntRange(min=1),
              help="Replicates per (document, policy) (repeatable; default: the pilot's).")
@click.option("--target", type=click.FloatRange(0.05, 0.999), default=None,
              help="Also find the cheapest (docs, replicates) giving every hypothesis this power.")
@click.option("--conservative", is_flag=True,
              help="With --target: reach the power at the low end of its range, not at the pilot's effect.")
@click.option("--level", type=click.FloatRange(0.5, 0.99), default=0.8, show_default=True,
              help="Coverage of the bootstrap interval of the effect behind the power range.")
@click.option("--window", type=click.IntRange(min=0), default=None,
              help="Truncate the observation window to W steps after divergence.")
@click.option("--policy-alias", "aliases", multiple=True, metavar="PLANNED=ACTUAL",
              help="Use pilot policy ACTUAL where the plan names PLANNED (repeatable).")
@click.option("--sims", type=click.IntRange(min=100), default=2000, show_default=True,
              help="Simulated studies per power value.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--difference", type=float, default=None,
              help="Power at this true mean difference A - B (raw units) for every hypothesis; tests at a "
                   "margin (equivalence, non-inferiority) default to 0.")
def power_command(traces: Path, plan_source: str, docs: tuple[int, ...], replicates: tuple[int, ...],
                  target: float | None, conservative: bool, level: float, window: int | None,
                  aliases: tuple[str, ...], sims: int, seed: int, difference: float | None) -> None:
    """Power of each hypothesis of a plan, from pilot TRACES, at a number of documents and replicates.

    The effect and the between-document and Monte Carlo variance of each hypothesis
    come from the pilot (divstats.variance_components); the range reflects the
    pilot's own uncertainty. Power is at the plan's alpha over the family size for
    Holm families (a lower bound of Holm's power).
    """
    try:
        plan = load_plan(plan_source)
        alias_map = parse_aliases(aliases)
        pilot = open_traces(traces)
        res = power(plan, pilot, docs=list(docs) or None, replicates=list(replicates) or None, level=level,
                    aliases=alias_map, window=window, n_sims=sims, seed=seed, difference=difference)
        click.echo(f"plan {plan.name} sha256={plan.sha256}")
        click.echo(f"pilot {traces}: {res.pilot_docs} documents, {res.pilot_replicates:g} replicates; "
                   f"range: {level:g} bootstrap interval of the standardised effect")
        for line in format_power_table(res.table) if len(res.table) else []:
            click.echo(line)
        for note in res.notes:
            click.echo(f"note: {note}")
        for line in row_notes(res.table, res.notes):
            click.echo(line)
        if plan.certifications:
            cert = certify_power(plan, pilot, docs=list(docs) or None, target=target or 0.8,
                                 n_sims=min(sims, 200), seed=seed, window=window)
            for line in format_certify_power(cert, target or 0.8):
                click.echo(line)
        if target is not None:
            des = design(plan, pilot, target, use="low" if conservative else "point", aliases=alias_map,
                         window=window, n_sims=min(sims, 1000), seed=seed)
            cm = des.cost_model
            click.echo(f"cost model ({cm.source}): {cm.policies} policies x (request {cm.request(0):.3g} + "
                       f"{cm.steps_per_replicate:.3g} steps/replicate x {cm.per_step:.3g}) {cm.unit}")
            for line in format_design_table(des.table, target):
                click.echo(line)
            click.echo(des.summary())
    except (DivstatsError, ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
