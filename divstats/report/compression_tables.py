"""The report's "How much can I compress?" section as display rows: the certified budgets, each
family's crossing of the margin, the section's first sentence, and the certified budget per
family that the figure stars (:func:`divstats.report.figures.compression_figure`).

The numbers are :func:`divstats.estimation.budget_curves.budget_curves`' and the plan's
``[[certify]]`` results (:func:`divstats.inference.certify.certify_family`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from divstats.report.tables import fmt

if TYPE_CHECKING:
    from divstats.report.analysis import Analysis

__all__ = ["certified_map", "compression_rows", "compression_status", "crossing_rows"]


def certified_map(an: Analysis) -> dict[tuple[str, str | None], str]:
    """(family key, model) -> the certified policy id ("" for none), for the figure's stars.

    Parameters
    ----------
    an : Analysis
        ``divstats.report.analysis.compute`` output.

    Returns
    -------
    dict of (str, str or None) to str
        Per family key and model (None without a ``model`` dim), the certified policy id;
        empty without a plan's certification or policy families.

    Examples
    --------
    >>> from divstats.report.analysis import compute
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(8, {"full": PolicyEffect(0.0), "snapkv@0.9": PolicyEffect(0.01),
    ...                         "snapkv@0.5": PolicyEffect(0.1)}, horizon=6, replicates=3)
    >>> plan = {"plan": {"name": "p", "salt": "s"}, "certify": [{"id": "C", "family": "snapkv",
    ...         "metric": "occurrence", "margin": 0.05, "split": "all"}]}
    >>> an = compute(ds, plan, n_resamples=99, progress=False)
    >>> certified_map(an)
    {('snapkv@*', None): ''}
    """
    out: dict[tuple[str, str | None], str] = {}
    pr, curves = an.plan_result, an.compression
    if pr is None or curves is None:
        return out
    cid = curves.attrs.get("certify_id", "")
    for (c_id, model), res in pr.certified.items():
        if c_id != cid or not res.budgets:
            continue
        for fam in curves["family"].values:
            one = curves.sel(model=model) if model is not None and "model" in curves.dims else curves
            members = [str(p) for p in one.sel(family=fam)["policy"].values if str(p)]
            if members == list(res.budgets):
                out[(str(fam), model)] = res.certified or ""
    return out


def compression_rows(an: Analysis) -> list[dict[str, str]]:
    """"How much can I compress?": one row per certification (and model), then each family's crossing.

    Parameters
    ----------
    an : Analysis
        ``divstats.report.analysis.compute`` output.

    Returns
    -------
    list of dict
        Display rows: family, model, metric, margin, budgets tested, certified budget with its KV kept,
        and the verdict in words; empty without policy families.

    Examples
    --------
    >>> from divstats.report.analysis import compute
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(8, {"full": PolicyEffect(0.0), "snapkv@0.9": PolicyEffect(0.01),
    ...                         "snapkv@0.5": PolicyEffect(0.1)}, horizon=6, replicates=3)
    >>> plan = {"plan": {"name": "p", "salt": "s"}, "certify": [{"id": "C", "family": "snapkv",
    ...         "metric": "occurrence", "margin": 0.05, "split": "all"}]}
    >>> an = compute(ds, plan, n_resamples=99, progress=False)
    >>> row = compression_rows(an)[0]
    >>> row["family"], row["budgets (most KV first)"], row["certified"]
    ('snapkv', 'snapkv@0.9, snapkv@0.5', 'none')
    """
    rows: list[dict[str, str]] = []
    pr, curves = an.plan_result, an.compression
    if curves is None:
        return rows
    if pr is not None and len(pr.certify):
        for r in pr.certify.itertuples(index=False):
            rows.append({"certify": str(r.id), "family": str(r.family), "model": str(r.model or "—"),
                         "metric": str(r.metric), "margin": f"{r.margin:g}",
                         "budgets (most KV first)": str(r.budgets).replace(",", ", "),
                         "tested": str(r.tested), "certified": r.certified or "none",
                         "KV kept": fmt(r.certified_kept) if r.certified else "—", "verdict": str(r.verdict),
                         "label": "confirmatory" if r.confirmatory else "exploratory"})
    return rows


def crossing_rows(an: Analysis) -> list[dict[str, str]]:
    """Each family's crossing of reference + margin (descriptive): KV kept where its curve meets the line.

    Parameters
    ----------
    an : Analysis
        ``divstats.report.analysis.compute`` output.

    Returns
    -------
    list of dict
        Display rows: family, model, documents, the crossing in KV kept and the band's
        interval for it; empty without policy families or without a margin.

    Examples
    --------
    >>> from divstats.report.analysis import compute
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(8, {"full": PolicyEffect(0.0), "snapkv@0.9": PolicyEffect(0.01),
    ...                         "snapkv@0.5": PolicyEffect(0.1)}, horizon=6, replicates=3)
    >>> plan = {"plan": {"name": "p", "salt": "s"}, "certify": [{"id": "C", "family": "snapkv",
    ...         "metric": "occurrence", "margin": 0.05, "split": "all"}]}
    >>> an = compute(ds, plan, n_resamples=99, progress=False)
    >>> [(r["family"], r["documents"]) for r in crossing_rows(an)]
    [('snapkv@*', '8')]
    """
    curves = an.compression
    if curves is None or not np.isfinite(curves.attrs.get("margin", math.nan)):
        return []
    rows = []
    models = list(curves["model"].values) if "model" in curves.dims else [None]
    for m in models:
        one = curves.sel(model=m) if m is not None else curves
        for fam in one["family"].values:
            c = one.sel(family=fam)
            x, lo, hi = (float(c[v]) for v in ("crossing", "crossing_low", "crossing_high"))
            rows.append({"family": str(fam), "model": "—" if m is None else str(m),
                         "documents": str(int(c["n_docs"])),
                         "crossing (KV kept)": fmt(x) if np.isfinite(x) else "not within the family",
                         "band interval": (f"[{fmt(lo)}, {fmt(hi)}]" if np.isfinite(lo) and np.isfinite(hi)
                                           else "—")})
    return rows


def compression_status(an: Analysis) -> str:
    """The section's first sentence: what the curves show and what was certified (or why not).

    Parameters
    ----------
    an : Analysis
        ``divstats.report.analysis.compute`` output.

    Returns
    -------
    str
        The text; "" without policy families.

    Examples
    --------
    >>> from divstats.report.analysis import compute
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(8, {"full": PolicyEffect(0.0), "snapkv@0.9": PolicyEffect(0.01),
    ...                         "snapkv@0.5": PolicyEffect(0.1)}, horizon=6, replicates=3)
    >>> plan = {"plan": {"name": "p", "salt": "s"}, "certify": [{"id": "C", "family": "snapkv",
    ...         "metric": "occurrence", "margin": 0.05, "split": "all"}]}
    >>> an = compute(ds, plan, n_resamples=99, progress=False)
    >>> text = compression_status(an)
    >>> text.startswith("Mean occurrence over documents"), "Dashed: reference + margin (0 + 0.05)" in text
    (True, True)
    """
    curves = an.compression
    if curves is None:
        return ""
    metric, level = curves.attrs.get("metric", ""), curves.attrs.get("level", 0.95)
    text = (f"Mean {metric} over documents against the KV each policy keeps, per policy family; bars: pointwise "
            f"{level:.0%} intervals, shaded: a band simultaneous over the family's budgets (studentized max-|t| "
            f"bootstrap over documents, docs/statistics.md §11); dotted: the Pareto front of every method's points.")
    if np.isfinite(curves.attrs.get("margin", math.nan)):
        text += (f" Dashed: reference + margin ({fmt(curves.attrs['reference_level'])} + "
                 f"{fmt(curves.attrs['margin'])}); ★: the budget certified non-inferior by fixed-sequence tests "
                 f"from the most to the least KV kept (no adjustment needed; below 50 documents each test is the "
                 f"betting test where the metric's range is known, and refused otherwise).")
    else:
        text += (" No [[certify]] in the plan: no margin, nothing certified "
                 "(docs/plans.md, \"How much can I compress?\").")
    return text
