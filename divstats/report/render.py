"""Rendering an :class:`~divstats.report.analysis.Analysis`: figures, the HTML page, the Markdown summary.

The page is the Jinja2 template ``divstats/templates/report.html.j2`` (package
data) filled with display rows from :mod:`divstats.report.tables` (and each section's own: ``floor_tables``,
``compression_tables``, ``answer_tables``) and figures from
:mod:`divstats.report.figures` embedded as base64 PNG, so the file is self-contained.
The Markdown summary repeats the headline tables.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from divstats.inference.choices import MARGIN_ALTERNATIVES
from divstats.report import figures as F
from divstats.report.answer_tables import answers_context, answers_text_table, make_answer_figures
from divstats.report.compression_tables import certified_map, compression_rows, compression_status, crossing_rows
from divstats.report.floor_tables import noise_floor_rows, noise_floor_status
from divstats.report.tables import (
    EXPLORATORY,
    branch_tv_rows,
    data_summary,
    decomposition_rows,
    decomposition_table,
    estimate_rows,
    plan_rows,
    speculative_rows,
    speculative_status,
    variance_rows,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from divstats.report.analysis import Analysis

__all__ = ["GENERATOR", "SUMMARY_HEADING", "figure_png", "make_figures", "render_html", "render_markdown",
           "reproduce_snippet"]

#: The page's ``<meta name="generator">``: how kvdiv recognises a report.html it wrote.
GENERATOR = "kvdiv analyze"
#: The first characters of every summary.md kvdiv writes.
SUMMARY_HEADING = "# kvdiv summary: "


def make_figures(an: Analysis) -> dict[str, Figure]:
    """Name → matplotlib Figure for every figure the report shows.

    Parameters
    ----------
    an : Analysis
        A computed analysis.

    Returns
    -------
    dict of str to matplotlib.figure.Figure
        ``survival`` and ``decomposition`` always; ``gap``, ``branch_tv``, ``logit``
        (traces with logit traces), ``interval``, ``variance``, ``margins`` and
        ``speculative`` (reference traces) when there is something to show.

    Examples
    --------
    >>> from divstats.report.analysis import compute
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(4, {"a": PolicyEffect(0.1), "b": PolicyEffect(0.2)}, horizon=6, replicates=3)
    >>> sorted(make_figures(compute(ds, n_resamples=99, progress=False)))
    ['branch_tv', 'decomposition', 'gap', 'interval', 'survival']
    """
    if not an.survival.data_vars:       # an answers dataset: no tokens, no drift figures
        return dict(make_answer_figures(an.answers))
    figs: dict[str, Any] = {"survival": F.survival_figure(an.survival),
                            "decomposition": F.decomposition_figure(an.aggregate)}
    rows = decomposition_rows(an)
    if rows:
        figs["gap"] = F.gap_figure(rows)
    if an.branch_tv is not None:
        figs["branch_tv"] = F.branch_tv_figure(an.branch_tv, an.plan.windows if an.plan else None)
        if an.logit_curves is not None and an.logit_curves.data_vars:
            figs["logit"] = F.logit_figure(an.logit_curves, an.branch_tv)
    if an.interval is not None and an.interval.sizes.get("window", 0) > 1:
        figs["interval"] = F.interval_figure(an.interval, an.aggregate)
    if an.variance is not None:
        figs["variance"] = F.variance_figure(an.variance)
    margins = _margin_table(an)
    if margins is not None:
        figs["margins"] = F.margin_figure(margins)
    if an.speculative is not None:
        figs["speculative"] = F.speculative_figure(an.speculative, level=an.options["level"])
    if an.compression is not None:
        figs["compression"] = F.compression_figure(an.compression, certified_map(an))
    figs.update(make_answer_figures(an.answers))
    return figs


def _margin_table(an: Analysis) -> Any:
    """The plan rows of tests at a margin (None when there are none)."""
    t = an.plan_result.table if an.plan_result is not None else None
    if t is None or "verdict" not in t or not t["direction"].isin(MARGIN_ALTERNATIVES).any():
        return None
    return t[t["direction"].isin(MARGIN_ALTERNATIVES)]


def figure_png(fig: Figure, dpi: int = 110) -> bytes:
    """A figure as PNG bytes.

    Parameters
    ----------
    fig : matplotlib.figure.Figure
        The figure.
    dpi : int
        Resolution.

    Returns
    -------
    bytes
        The PNG file.

    Examples
    --------
    >>> from matplotlib.figure import Figure
    >>> figure_png(Figure())[:4]
    b'\\x89PNG'
    """
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def _template():
    import jinja2  # lazy: the template engine is needed only to render the HTML page

    env = jinja2.Environment(loader=jinja2.PackageLoader("divstats", "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    return env.get_template("report.html.j2")


#: Columns of running text: in a wrapping table (class "wrap") they get a readable width, so the
#: table fits a 1,300-px window instead of clipping its verdicts.
LONG_COLUMNS: tuple[str, ...] = ("verdict",)


def render_html(an: Analysis, figs: Mapping[str, bytes]) -> str:
    """The self-contained report page.

    Parameters
    ----------
    an : Analysis
        A computed analysis.
    figs : mapping of str to bytes
        PNG files by figure name (:func:`make_figures` then :func:`figure_png`).

    Returns
    -------
    str
        The HTML document.

    Examples
    --------
    >>> from divstats.report.analysis import compute
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(4, {"a": PolicyEffect(0.1), "b": PolicyEffect(0.2)}, horizon=6, replicates=3)
    >>> page = render_html(compute(ds, n_resamples=99, progress=False), {})
    >>> page.startswith("<!DOCTYPE html>"), "every comparison is exploratory" in page
    (True, True)
    """
    pr = an.plan_result
    counts = pr.split["split"].value_counts().to_dict() if pr is not None else {}
    return _template().render(
        generator=GENERATOR, title=an.plan.name if an.plan else "descriptive (no plan)", plan=an.plan,
        split_counts={"confirmatory": counts.get("confirmatory", 0), "exploratory": counts.get("exploratory", 0)},
        options=", ".join(f"{k}={v}" for k, v in an.options.items()),
        notes=_notes(an), exploratory=EXPLORATORY, plan_rows=plan_rows(pr), n_docs=an.traces.sizes["doc"],
        level_percent=int(an.options["level"] * 100), **_drift_context(an), answers=answers_context(an.answers),
        long_columns=LONG_COLUMNS,
        images={k: base64.b64encode(v).decode() for k, v in figs.items()}, reproduce=reproduce_snippet(an))


def _drift_context(an: Analysis) -> dict[str, Any]:
    """The drift sections' rows; empty for an answers dataset (scores without tokens: nothing drifts)."""
    if not an.survival.data_vars:
        return {"drift": False,
                "summary": {"kind": "answers (scores without tokens)", "documents": str(an.traces.sizes["doc"]),
                            "policies": ", ".join(str(p) for p in an.traces["policy"].values)},
                "estimate_rows": [], "decomposition_rows": [], "branch_rows": [], "interval_method": "",
                "variance_rows": [], "noise_floor_status": "no tokens: nothing to compare with a noise floor",
                "noise_floor_rows": [], "speculative_status": "", "speculative_rows": [], "compression_status": "",
                "compression_rows": [], "crossing_rows": []}
    return {"drift": True, "summary": data_summary(an.traces), "estimate_rows": estimate_rows(an),
            "decomposition_rows": decomposition_table(an), "branch_rows": branch_tv_rows(an.branch_tv),
            "interval_method": str(an.aggregate_ci.attrs.get("methods_used", "")),
            "variance_rows": variance_rows(an.variance) if an.variance is not None else [],
            "noise_floor_status": noise_floor_status(an), "noise_floor_rows": noise_floor_rows(an),
            "speculative_status": speculative_status(an), "speculative_rows": speculative_rows(an),
            "compression_status": compression_status(an), "compression_rows": compression_rows(an),
            "crossing_rows": crossing_rows(an)}


def _notes(an: Analysis) -> list[str]:
    devs = an.plan_result.deviations if an.plan_result is not None else []
    return an.notes + _interval_notes(an) + [f"Deviation from the plan: {d}" for d in devs]


def _interval_notes(an: Analysis) -> list[str]:
    """Why intervals of the descriptive tables are missing (refused) or cover fewer documents."""
    extra = []
    for res, ci in an.decompositions:
        for why in dict.fromkeys((ci.reason, ci.share_reason)):   # a refused interval also refuses the shares
            if why:
                extra.append(f"Decomposition {res.a} vs {res.b}: {why}.")
    if an.aggregate_ci.attrs.get("reason"):
        extra.append(f"Aggregate intervals: {an.aggregate_ci.attrs['reason']}.")
    dropped = an.aggregate_ci.get("n_dropped")
    if dropped is not None and int(dropped.max()) > 0:
        extra.append("Aggregate intervals: documents without data for a policy were dropped from that "
                     f"policy's interval (up to {int(dropped.max())} per policy; results.nc aggregate_ci_n_dropped).")
    return extra


def reproduce_snippet(an: Analysis) -> str:
    """Python that recomputes the report's numbers with the public API.

    Parameters
    ----------
    an : Analysis
        A computed analysis.

    Returns
    -------
    str
        Source code (``TRACES``, ``A`` and ``B`` are placeholders).

    Examples
    --------
    >>> from divstats.report.analysis import compute
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(4, {"a": PolicyEffect(0.1)}, horizon=6, replicates=3)
    >>> "divstats.estimate(ds, window=None)" in reproduce_snippet(compute(ds, n_resamples=99, progress=False))
    True
    """
    w = an.options["window"]
    win = "None" if w == -1 else str(w)
    o = an.options
    lines = ["import divstats, protocols",
             "from divstats import decompose",
             "ds = protocols.open_traces(TRACES)",
             f"est = divstats.estimate(ds, window={win}); agg = divstats.aggregate(est)"]
    if an.plan is not None:
        lines.append(f"res = divstats.run_plan(ds, {an.plan.source!r}, aliases={json.loads(o['policy_aliases'])!r}, "
                     f"window={win}, seed={o['seed']}, n_resamples={o['n_resamples']})")
    lines.append(f"dec = decompose(est, A, B); dec.confidence_interval({o['level']}, "
                 f"n_resamples={o['n_resamples']}, seed={o['seed']})")
    return "\n".join(lines) + "\n"


def render_markdown(an: Analysis) -> str:
    """The headline tables as Markdown (summary.md).

    Parameters
    ----------
    an : Analysis
        A computed analysis.

    Returns
    -------
    str
        Markdown starting with :data:`SUMMARY_HEADING`.

    Examples
    --------
    >>> from divstats.report.analysis import compute
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(4, {"a": PolicyEffect(0.1)}, horizon=6, replicates=3)
    >>> render_markdown(compute(ds, n_resamples=99, progress=False)).splitlines()[0]
    '# kvdiv summary: descriptive (no plan)'
    """
    if an.plan is not None:
        lines = [f"{SUMMARY_HEADING}{an.plan.name}", "",
                 f"- plan: `{an.plan.source}`", f"- plan SHA-256: `{an.plan.sha256}`"]
    else:
        lines = [f"{SUMMARY_HEADING}descriptive (no plan)", "",
                 "- plan: none; every comparison is exploratory"]
    drift = _drift_context(an)
    lines += [f"- {k}: {v}" for k, v in drift["summary"].items()]
    devs = an.plan_result.deviations if an.plan_result is not None else []
    lines += [f"- note: {n}" for n in an.notes + _interval_notes(an)] + [f"- deviation: {d}" for d in devs]
    if an.plan is not None:
        lines += ["", "## Plan results", "", _md_table(plan_rows(an.plan_result))]
        margins = _margin_table(an)
        if margins is not None:
            lines += ["", "## Verdicts at a margin", ""] + [
                f"- {r.id} ({r.metric}, {r.a} − {r.b}): {r.verdict}" for r in margins.itertuples(index=False)]
    if an.answers is not None and an.answers.has_answers:
        lines += ["", f"## Does it change the answer? — {EXPLORATORY}", "", "```",
                  answers_text_table(an.answers.table), "```"]
    if not an.survival.data_vars:      # an answers dataset: nothing drifts
        return "\n".join(lines)
    lines += ["", f"## Aggregate estimates — {EXPLORATORY}", "", _md_table(drift["estimate_rows"]), ""]
    lines += _noise_floor_markdown(an)
    if an.speculative is not None:
        lines += [f"## Speculative decoding — {EXPLORATORY}", "", speculative_status(an), "",
                  _md_table(speculative_rows(an)), ""]
    if an.compression is not None:
        lines += ["## How much can I compress?", "", compression_status(an), ""]
        lines += [f"- {r['certify']} ({r['family']}{'' if r['model'] == '—' else ', ' + r['model']}): {r['verdict']}"
                  for r in compression_rows(an)] + [""]
        if crossing_rows(an):
            lines += [_md_table(crossing_rows(an)), ""]
    dec = decomposition_table(an, shares=False)
    if dec:
        lines += [f"## Gap decomposition — {EXPLORATORY}", "", _md_table(dec), ""]
    return "\n".join(lines)


def _noise_floor_markdown(an: Analysis) -> list[str]:
    """The summary's noise-floor section: the status line and, with a control, its table."""
    rows = noise_floor_rows(an)
    return [f"## Noise floor — {EXPLORATORY}", "", noise_floor_status(an), "",
            *([_md_table(rows), ""] if rows else [])]


def _md_table(rows: Sequence[Mapping[str, Any]]) -> str:
    if not rows:
        return "_none_"
    cols = list(rows[0])

    def esc(s: Any) -> str:
        return str(s).replace("|", "\\|")

    out = ["| " + " | ".join(esc(c) for c in cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(esc(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(out)
