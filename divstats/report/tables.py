"""The report's tables as display rows (strings), shared by the HTML and Markdown renderers.

Numbers are formatted here once (:func:`fmt`, :func:`fmt_p`), so the page, the
Markdown summary and any other renderer show the same digits.  Here are the plan's
table and the per-policy tables of the estimands (estimates, decomposition, branch TV,
variance, speculative decoding) with the data summary; the noise-floor section's rows
are :mod:`divstats.report.floor_tables`, the "How much can I compress?" section's
:mod:`divstats.report.compression_tables`, the answers section's
:mod:`divstats.report.answer_tables`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import xarray as xr

from divstats.design.pilot import counted_replicates
from divstats.estimands import ACCEPTED_PER_CALL, TARGET_CALLS, TOKENS_PER_CALL, names
from divstats.inference.decompose import PARTS
from divstats.plans.run import PlanResult

if TYPE_CHECKING:
    from divstats.report.analysis import Analysis

__all__ = [
    "EXPLORATORY", "SUMMARY_QUANTITIES", "branch_tv_rows", "data_summary", "decomposition_rows",
    "decomposition_table", "estimate_rows", "fmt", "fmt_ci", "fmt_p",
    "plan_rows", "SPECULATIVE_QUANTITIES", "speculative_rows", "speculative_status", "unify", "variance_rows",
]

#: Aggregate quantities shown in the report's estimates table (in order; ``divstats.estimands``).
SUMMARY_QUANTITIES: tuple[str, ...] = names(summary=True)
EXPLORATORY = "exploratory: descriptive, not part of the plan"
_DECOMPOSITION_PARTS = PARTS


def fmt(x: Any, digits: int = 4) -> str:
    """Compact number formatting for tables: NaN → '—', ±inf → '±∞', a true minus sign.

    Parameters
    ----------
    x : Any
        A number (bools and integers are shown as such; anything else with ``str``).
    digits : int
        Significant digits.

    Returns
    -------
    str
        The formatted value.

    Examples
    --------
    >>> fmt(-0.25), fmt(float("nan")), fmt(1.23456e-7)
    ('−0.25', '—', '1.235e-07')
    """
    if isinstance(x, (bool, np.bool_)):
        return "yes" if x else "no"
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    try:
        v = float(x)
    except (TypeError, ValueError):
        return str(x)
    if np.isnan(v):
        return "—"
    if np.isinf(v):
        return "∞" if v > 0 else "−∞"
    if v != 0 and (abs(v) < 10 ** -(digits - 1) or abs(v) >= 10 ** (digits + 2)):
        text = f"{v:.{digits - 1}e}"
    else:
        text = f"{v:.{digits}g}"
    return text.replace("-", "−", 1) if text.startswith("-") else text


def fmt_p(p: Any) -> str:
    """A p-value: 4 decimals, scientific below 0.001, '—' for NaN.

    Parameters
    ----------
    p : float
        The p-value.

    Returns
    -------
    str
        The formatted value.

    Examples
    --------
    >>> fmt_p(0.04321), fmt_p(1e-5)
    ('0.0432', '1.00e-05')
    """
    v = float(p)
    if np.isnan(v):
        return "—"
    return f"{v:.2e}" if v < 1e-3 else f"{v:.4f}"


def fmt_ci(lo: Any, hi: Any) -> str:
    """An interval as ``[lo, hi]`` with :func:`fmt`.

    Parameters
    ----------
    lo, hi : float
        The bounds.

    Returns
    -------
    str
        The formatted interval.

    Examples
    --------
    >>> fmt_ci(0.1, float("inf"))
    '[0.1, ∞]'
    """
    return f"[{fmt(lo)}, {fmt(hi)}]"


def plan_rows(pr: PlanResult | None) -> list[dict[str, str]]:
    """The plan table as display rows (none without a plan).

    Parameters
    ----------
    pr : PlanResult or None
        ``run_plan``'s result.

    Returns
    -------
    list of dict
        One row per table row: comparison, H1, test, p, adjusted p, effect with its
        interval, mean difference with its interval, deviation and note.

    Examples
    --------
    >>> plan_rows(None)
    []
    """
    if pr is None:
        return []
    rows = []
    for r in pr.table.itertuples(index=False):
        comp = f"{r.a} − {r.b}" + (f" ({r.policy})" if r.policy else "") + (f" [{r.window}]" if r.window else "")
        rows.append({
            "id": r.id, "family": r.family, "label": r.label, "metric": r.metric, "comparison": comp,
            "H1": _h1(r),
            "test": r.test, "estimand": "pseudo-median" if r.test == "wilcoxon" else "mean",
            "n docs": str(r.n_docs) + (f" ({r.n_dropped} dropped)" if r.n_dropped else ""),
            "statistic": fmt(r.statistic), "p": fmt_p(r.p_value),
            "p (Holm)" if r.correction == "holm" else "p (adj.)": fmt_p(r.p_adjusted),
            "reject": "yes" if r.reject else "no",
            "effect": f"{fmt(r.effect)} ({'HL' if r.effect_kind == 'hodges_lehmann' else 'mean'})",
            f"{int(round((1 - r.alpha) * 100))}% CI": fmt_ci(r.ci_low, r.ci_high),
            "mean diff [CI]": f"{fmt(r.mean_difference)} {fmt_ci(r.mean_ci_low, r.mean_ci_high)}",
            "deviation": r.deviation or "", "note": r.note or "",
            **({"verdict": r.verdict} if getattr(r, "verdict", "") else {}),
        })
    return unify(rows)


def _h1(r: Any) -> str:
    """The row's alternative in symbols (tests at a margin: the region shown, with the margin)."""
    margin = getattr(r, "margin", float("nan"))
    if r.direction == "equivalence":
        return f"|A − B| < {margin:g}"
    if r.direction == "noninferiority":
        return f"A − B < {margin:g}" if r.worse == "larger" else f"A − B > {-margin:g}"
    return {"less": "A − B < 0", "greater": "A − B > 0"}.get(r.direction, "A − B ≠ 0")


def unify(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Same columns, as strings, for every row (p (Holm) / p (adj.) and CI level may vary).

    Parameters
    ----------
    rows : sequence of mapping
        Display rows, possibly with different keys.

    Returns
    -------
    list of dict
        Every row with the union of the columns (first-seen order); missing cells ''.

    Examples
    --------
    >>> unify([{"a": 1}, {"b": 2}])
    [{'a': '1', 'b': ''}, {'a': '', 'b': '2'}]
    """
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    return [{c: str(r.get(c, "")) for c in cols} for r in rows]


def estimate_rows(an: Analysis) -> list[dict[str, str]]:
    """Aggregate estimates per policy (and model) with their document-bootstrap intervals.

    Parameters
    ----------
    an : Analysis
        A computed analysis.

    Returns
    -------
    list of dict
        ``model`` (when several), ``policy`` and ``value [low, high]`` per
        :data:`SUMMARY_QUANTITIES`.

    Examples
    --------
    >>> from divstats.report.analysis import compute
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(4, {"a": PolicyEffect(0.1)}, horizon=6, replicates=3)
    >>> estimate_rows(compute(ds, n_resamples=99, progress=False))[0]["policy"]
    'a'
    """
    agg, ci = an.aggregate, an.aggregate_ci
    models = list(agg["model"].values) if "model" in agg.dims else [None]
    rows = []
    for m in models:
        for pol in agg["policy"].values:
            sel = {"policy": pol} if m is None else {"policy": pol, "model": m}
            row = {"model": str(m)} if m is not None else {}
            row["policy"] = str(pol)
            for q in SUMMARY_QUANTITIES:
                v = float(agg[q].sel(sel))
                row[q] = f"{fmt(v)} {fmt_ci(ci[q + '_low'].sel(sel), ci[q + '_high'].sel(sel))}"
            rows.append(row)
    return rows


def decomposition_rows(an: Analysis) -> list[dict[str, Any]]:
    """Every decomposition as numbers (one row per comparison and model), for tables and figures.

    Parameters
    ----------
    an : Analysis
        A computed analysis.

    Returns
    -------
    list of dict
        ``label``, ``a``, ``b``, ``n_docs``, ``M_A``, ``M_B`` and, per part
        (gap, first, exposure, rate), its value, ``_low``, ``_high`` and ``_share``.

    Examples
    --------
    >>> from divstats.report.analysis import compute
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(4, {"a": PolicyEffect(0.1), "b": PolicyEffect(0.2)}, horizon=6, replicates=3)
    >>> decomposition_rows(compute(ds, n_resamples=99, progress=False))[0]["label"]
    'b vs a'
    """
    rows = []
    for res, ci in an.decompositions:
        keys = list(res.gap["model"].values) if isinstance(res.gap, xr.DataArray) else [None]
        for m in keys:
            def g(x: Any, m: Any = m) -> float:
                return float(x) if m is None else float(x.sel(model=m))

            row = {"label": f"{res.a} vs {res.b}" + ("" if m is None else f" ({m})"), "a": res.a, "b": res.b,
                   "n_docs": g(res.n_docs), "M_A": g(res.mismatch_a), "M_B": g(res.mismatch_b)}
            for name in _DECOMPOSITION_PARTS:
                row[name] = g(getattr(res, name))
                row[f"{name}_low"] = g(getattr(ci.low, name))
                row[f"{name}_high"] = g(getattr(ci.high, name))
                row[f"{name}_share"] = g(getattr(res.shares, name))
                if ci.share_low is not None:
                    row[f"{name}_share_low"] = g(getattr(ci.share_low, name))
                    row[f"{name}_share_high"] = g(getattr(ci.share_high, name))
            rows.append(row)
    return rows


def decomposition_table(an: Analysis, *, shares: bool = True) -> list[dict[str, str]]:
    """The decomposition as display rows: the gap and its parts with intervals (and shares).

    Parameters
    ----------
    an : Analysis
        A computed analysis.
    shares : bool
        Include the counts, the two mismatch fractions and the shares (the HTML
        page does; the Markdown summary does not).

    Returns
    -------
    list of dict
        One row per comparison (and model).

    Examples
    --------
    >>> from divstats.report.analysis import compute
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(4, {"a": PolicyEffect(0.1), "b": PolicyEffect(0.2)}, horizon=6, replicates=3)
    >>> list(decomposition_table(compute(ds, n_resamples=99, progress=False), shares=False)[0])
    ['comparison', 'gap', 'first', 'exposure', 'rate']
    """
    out = []
    for r in decomposition_rows(an):
        def cell(n: str, r: dict[str, Any] = r) -> str:
            return f"{fmt(r[n])} {fmt_ci(r[n + '_low'], r[n + '_high'])}"

        if not shares:
            out.append({"comparison": r["label"], **{n: cell(n) for n in _DECOMPOSITION_PARTS}})
            continue
        out.append({"comparison": r["label"], "n docs": str(int(r["n_docs"])), "M_A": fmt(r["M_A"]),
                    "M_B": fmt(r["M_B"]),
                    **{f"{n if n == 'gap' else 'Δ' + n} [CI]": cell(n) for n in _DECOMPOSITION_PARTS},
                    **{f"share {n} [CI]": _share_cell(r, n) for n in _DECOMPOSITION_PARTS[1:]}})
    return out


def _share_cell(r: Mapping[str, Any], n: str) -> str:
    """A share with its interval; "—" (refused) where the gap's interval covers 0."""
    lo, hi = r.get(f"{n}_share_low", float("nan")), r.get(f"{n}_share_high", float("nan"))
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return "— (refused: see notes)"
    return f"{fmt(r[n + '_share'], 3)} {fmt_ci(lo, hi)}"


def branch_tv_rows(branch: xr.Dataset | None) -> list[dict[str, str]]:
    """Branch-aligned TV by age with the replicate counts beside every value.

    Per policy (and model): the mean over documents of the per-document
    ``branch_tv`` at each age (documents where no branch reached the age are
    skipped), and in brackets the replicates whose branch reached it, summed over
    documents, and how many documents contributed. Ages nothing reached show "—".

    Parameters
    ----------
    branch : xarray.Dataset or None
        ``divstats.branch_tv(ds)``.

    Returns
    -------
    list of dict
        ``policy`` (and ``model``), then one ``age k`` cell per age.

    Examples
    --------
    >>> import divstats
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(3, {"a": PolicyEffect(0.3)}, horizon=4, replicates=5)
    >>> list(branch_tv_rows(divstats.branch_tv(ds))[0])[:2]
    ['policy', 'age 0']
    """
    if branch is None or "branch_tv" not in branch:
        return []
    value = branch["branch_tv"].mean("doc", skipna=True)
    count = branch["branch_tv_count"].sum("doc")
    docs = (branch["branch_tv_count"] > 0).sum("doc")
    models = list(value["model"].values) if "model" in value.dims else [None]
    rows = []
    for m in models:
        for pol in value["policy"].values:
            sel = {"policy": pol} if m is None else {"policy": pol, "model": m}
            row = ({"model": str(m)} if m is not None else {}) | {"policy": str(pol)}
            for k in value["age"].values:
                v, c, d = (float(x.sel({**sel, "age": k})) for x in (value, count, docs))
                row[f"age {int(k)}"] = "—" if not np.isfinite(v) else f"{fmt(v, 3)} ({int(c)}; {int(d)} docs)"
            rows.append(row)
    return rows


def variance_rows(variance: xr.Dataset) -> list[dict[str, str]]:
    """Median variance ratio and efficiency per policy (the variance check's table).

    Parameters
    ----------
    variance : xarray.Dataset
        ``divstats.variance_check(ds)``.

    Returns
    -------
    list of dict
        ``policy``, ``median variance ratio``, ``median efficiency``.

    Examples
    --------
    >>> import xarray as xr
    >>> v = xr.Dataset({"variance_ratio": (("doc", "policy"), [[0.5]]), "efficiency": (("doc", "policy"), [[2.0]])},
    ...                coords={"policy": ["a"]})
    >>> variance_rows(v)
    [{'policy': 'a', 'median variance ratio': '0.5', 'median efficiency': '2'}]
    """
    return [{"policy": str(p), "median variance ratio": fmt(float(variance["variance_ratio"].sel(policy=p).median())),
             "median efficiency": fmt(float(variance["efficiency"].sel(policy=p).median()))}
            for p in variance["policy"].values]


def data_summary(ds: xr.Dataset) -> dict[str, str]:
    """What the traces are: kind, T, W, vocabulary, models, counts, sampling, producer.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace dataset.

    Returns
    -------
    dict of str to str
        Label → value, in display order.

    Examples
    --------
    >>> import xarray as xr
    >>> data_summary(xr.Dataset(coords={"policy": ["a"]}, attrs={"kind": "coupled"}))["kind"]
    'coupled'
    """
    a = ds.attrs
    models = [str(m) for m in ds["model"].values] if "model" in ds.dims else [str(a.get("model", ""))]
    vocab, reps = str(a.get("vocab_size", "")), str(ds.sizes.get("replicate", 0))
    if "model" in ds.dims:
        # each model's own: combined models keep their vocabularies, and a model studied at
        # a smaller R holds absent replicates in the others' slots
        if "vocab_size" in ds.coords:
            vocab = _per_model(models, [int(v) for v in ds["vocab_size"].values])
        if "replicate" in ds.dims and ds.data_vars:
            counted = counted_replicates(ds)
            reps = _per_model(models, [int(counted.sel(model=m).max()) for m in ds["model"].values])
    return {
        "kind": str(a.get("kind", "")), "horizon T": str(a.get("horizon", "")),
        "observed window W": str(a.get("window", "")), "vocabulary": vocab,
        "model(s)": ", ".join(m for m in models if m) or "—",
        "documents": str(ds.sizes.get("doc", 0)), "policies": ", ".join(str(p) for p in ds["policy"].values),
        "replicates per (doc, policy)": reps,
        "sampling": str(a.get("sampling", "")), "producer": str(a.get("producer", "")),
    }


def _per_model(models: list[str], values: list[int]) -> str:
    """One value when the models agree, else each model's (``4 (a), 2 (b)``)."""
    if len(set(values)) == 1:
        return str(values[0])
    return ", ".join(f"{v} ({m})" for m, v in zip(models, values, strict=True))


# --------------------------------------------------------------------------- speculative decoding

#: The speculative-decoding table's quantities, in column order.
SPECULATIVE_QUANTITIES: tuple[str, ...] = (TOKENS_PER_CALL, ACCEPTED_PER_CALL, TARGET_CALLS, "speedup")


def speculative_status(an: Analysis) -> str:
    """The speculative-decoding section's first line: what the numbers are, the cost ratio, the best γ.

    Parameters
    ----------
    an : Analysis
        A computed analysis with ``an.speculative`` (reference traces).

    Returns
    -------
    str
        The sentence; "" when the analysis has no such section.

    Examples
    --------
    >>> import numpy as np
    >>> from divstats.report.analysis import compute
    >>> from divstats.truth.simulate import simulate
    >>> ds = simulate(lambda h: np.array([0.6, 0.4]), lambda h: np.array([0.5, 0.5]), 2, 6, 20, kind="reference")
    >>> speculative_status(compute(ds, n_resamples=99, progress=False))[:31]
    'Q (the policy) drafts γ tokens,'
    """
    sp = an.speculative
    if sp is None:
        return ""
    text = ("Q (the policy) drafts γ tokens, P (the full model) verifies them in one call (docs/statistics.md §10). "
            f"Estimated from the reference traces by the forward recursion over drafts accepted, T = "
            f"{int(an.traces.attrs['horizon'])}; tokens per call = E[tokens] / E[target calls].")
    if "speedup" in sp:
        best = ", ".join(f"{p}{'' if m is None else f' ({m})'}: γ = {int(sp['best_gamma'].sel(policy=p, **sel))}"
                         for m, sel in _model_selections(sp) for p in sp["policy"].values)
        text += (f" Speedup over plain decoding at cost ratio c = {fmt(float(sp.attrs['cost_ratio']))} "
                 f"(one draft step / one target step): tokens per call / (1 + γc). Best γ — {best}.")
    else:
        text += (" No speedup: give the cost ratio of one draft step to one target step "
                 "(kvdiv analyze --cost-ratio C); the traces do not time the two models apart.")
    return text


def speculative_rows(an: Analysis) -> list[dict[str, str]]:
    """One row per (policy, γ): each quantity with its interval over documents, the best γ starred.

    Parameters
    ----------
    an : Analysis
        A computed analysis.

    Returns
    -------
    list of dict
        Display rows (empty without a speculative-decoding section).

    Examples
    --------
    >>> import numpy as np
    >>> from divstats.report.analysis import compute
    >>> from divstats.truth.simulate import simulate
    >>> ds = simulate(lambda h: np.array([0.6, 0.4]), lambda h: np.array([0.5, 0.5]), 2, 6, 20, kind="reference")
    >>> list(speculative_rows(compute(ds, n_resamples=99, progress=False))[0])
    ['policy', 'γ', 'tokens_per_call', 'accepted_per_call', 'target_calls']
    """
    sp = an.speculative
    if sp is None:
        return []
    rows = []
    for model, sel in _model_selections(sp):
        for pol in sp["policy"].values:
            best = int(sp["best_gamma"].sel(policy=pol, **sel)) if "best_gamma" in sp else None
            for g in sp["gamma"].values:
                cell = sp.sel(policy=pol, gamma=g, **sel)
                row = ({} if model is None else {"model": str(model)}) | {
                    "policy": str(pol), "γ": f"{int(g)}{' ★' if best == int(g) else ''}"}
                for q in SPECULATIVE_QUANTITIES:
                    if q in cell:
                        row[q] = f"{fmt(cell[q])} {fmt_ci(cell[q + '_low'], cell[q + '_high'])}"
                rows.append(row)
    return rows


def _model_selections(ds: xr.Dataset) -> list[tuple[Any, dict[str, Any]]]:
    """(model, its selection) per model along a ``model`` dim; one ``(None, {})`` without one."""
    if "model" not in ds.dims:
        return [(None, {})]
    return [(m, {"model": m}) for m in ds["model"].values]
