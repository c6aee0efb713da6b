"""``analyze``: estimates, the plan's tests, figures and a self-contained report.

Writes three files to ``out_dir``:

* ``report.html`` — self-contained (figures embedded as base64 PNG): data summary,
  the plan's hash and split, plan results (raw and Holm p-values, effect sizes with
  intervals, confirmatory vs exploratory), then the exploratory (descriptive)
  sections: aggregate estimates with document-bootstrap intervals, gap
  decompositions, survival, branch-aligned TV, sharp intervals by W, variance check;
* ``summary.md`` — the same headline numbers as Markdown;
* ``results.nc`` — every number above as one xarray Dataset (h5netcdf), see
  :func:`results_dataset` and docs/report.md for the variable names.

Every number comes from the public API (``divstats.estimate``, ``aggregate``,
``survival``, ``branch_tv``, ``interval_by_window``, ``variance_check``,
``decompose``, ``run_plan``) applied to the same traces with the same options.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import io
import json
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from divstats import figures as F
from divstats.decompose import DecompositionInterval, DecompositionResult, _as_da, decompose
from divstats.estimators import _MEAN_OVER_DOCS, _derive
from divstats.plans import Plan, PlanResult, load_plan, run_plan

#: Aggregate quantities shown in the report's estimates table (in order).
SUMMARY_QUANTITIES: tuple[str, ...] = (
    "occurrence", "rmtd", "exposure", "rate", "mismatch_fraction", "first_mismatch_contribution",
    "exposure_contribution", "loss_lower", "loss_upper",
)
EXPLORATORY = "exploratory: descriptive, not part of the plan"


@dataclass
class Analysis:
    """Everything ``analyze`` computed; ``results`` is what ``results.nc`` holds."""

    traces: xr.Dataset
    plan: Plan
    estimates: xr.Dataset
    aggregate: xr.Dataset
    aggregate_ci: xr.Dataset
    survival: xr.Dataset
    branch_tv: xr.Dataset | None
    interval: xr.Dataset | None
    variance: xr.Dataset | None
    plan_result: PlanResult
    decompositions: list[tuple[DecompositionResult, DecompositionInterval]]
    notes: list[str]
    options: dict[str, Any]
    results: xr.Dataset | None = None
    paths: dict[str, Path] = field(default_factory=dict)


# ---------------------------------------------------------------------------
# Computation
# ---------------------------------------------------------------------------

def aggregate_intervals(est: xr.Dataset, *, level: float = 0.95, n_resamples: int = 2000,
                        seed: int = 0) -> xr.Dataset:
    """Percentile bootstrap over documents for the aggregate quantities.

    Each resample draws documents with replacement (the same draw for every
    policy) and recomputes the aggregate exactly as ``divstats.aggregate`` does:
    document means, rate = Σ post / Σ exposure, and the derived quantities.
    Returns ``<name>_low``/``<name>_high`` over (policy[, model]).
    """
    T = int(est.attrs["horizon"])
    n = est.sizes["doc"]
    idx = np.random.default_rng(seed).integers(0, n, (n_resamples, n))
    means = {}
    for name in _MEAN_OVER_DOCS:
        arr = np.asarray(est[name].transpose("doc", ...).values, dtype=float)
        # Batches of resamples keep memory at ~500 x n_docs x (policy, model) values.
        means[name] = np.concatenate([arr[idx[i:i + 500]].mean(axis=1) for i in range(0, n_resamples, 500)])
    parts = _derive(means["occurrence"], means["exposure"], means["post_mismatch"], T)
    lower = means["occurrence"] + means["window_mismatch"]
    derived = {**{k: means[k] for k in ("occurrence", "rmtd", "exposure")},
               **{k: parts[k] for k in ("rate", "mismatch_fraction", "first_mismatch_contribution",
                                        "exposure_contribution")},
               "loss_lower": lower, "loss_upper": lower + means["tail_capacity"]}
    template = est["occurrence"].isel(doc=0, drop=True)
    template = template.drop_vars([c for c in template.coords if not template[c].dims])
    a = (1 - level) / 2
    out = {}
    for name, boot in derived.items():
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices: not identified
            lo, hi = np.nanquantile(boot, [a, 1 - a], axis=0) if np.isfinite(boot).any() else (
                np.full(boot.shape[1:], np.nan), np.full(boot.shape[1:], np.nan))
        out[f"{name}_low"] = template.copy(data=lo)
        out[f"{name}_high"] = template.copy(data=hi)
    return xr.Dataset(out, attrs={"level": level, "n_resamples": n_resamples, "seed": seed,
                                  "method": "percentile bootstrap over documents"})


def _interval_windows(ds: xr.Dataset) -> list[int]:
    """A grid of observation windows W for the sharp-interval curve."""
    T = int(ds.attrs["horizon"])
    kind = ds.attrs.get("kind")
    if kind == "reference":
        return [0]
    top = T - 1 if kind == "coupled" else min(int(ds.attrs.get("window", T)), T - 1)
    grid = np.unique(np.round(np.linspace(0, top, min(top + 1, 9))).astype(int))
    return [int(w) for w in grid]


def _decomposition_pairs(plan_result: PlanResult, policies: Sequence[str]) -> list[tuple[str, str]]:
    """Policy pairs the plan compares (after aliases); all vs the first policy if none."""
    pairs: list[tuple[str, str]] = []
    t = plan_result.table
    for a, b, pol in zip(t["a"], t["b"], t["policy"]):
        if not pol and a in policies and b in policies and (a, b) not in pairs:
            pairs.append((a, b))
    if not pairs and len(policies) > 1:
        pairs = [(p, policies[0]) for p in policies[1:]]
    return pairs


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, file=sys.stderr, disable=not enabled, desc="analyze", unit="step",
                leave=False)


def compute(traces: xr.Dataset, plan: Plan | str | Path | Mapping[str, Any], *, window: int | None = None,
            policy_aliases: Mapping[str, str] | None = None, seed: int = 0, n_resamples: int = 9999,
            level: float = 0.95, interval_windows: Sequence[int] | None = None,
            progress: bool = True) -> Analysis:
    """Run every estimator, the plan and the decompositions on ``traces`` (no files written)."""
    import divstats as D

    plan = plan if isinstance(plan, Plan) else load_plan(plan)
    notes: list[str] = []
    kind = traces.attrs.get("kind")
    steps = ["estimate", "survival", "branch TV", "interval by W", "variance check", "plan",
             "decomposition", "figures"]
    bar = _progress(len(steps), progress)

    def step(name: str) -> None:
        bar.set_postfix_str(name)

    step("estimate")
    est = D.estimate(traces, window=window)
    agg = D.aggregate(est)
    agg_ci = aggregate_intervals(est, level=level, n_resamples=n_resamples, seed=seed)
    bar.update()
    step("survival")
    surv = D.survival(traces)
    bar.update()
    step("branch TV")
    bt = None
    if kind == "reference":
        notes.append("Reference traces observe nothing after divergence: no branch-aligned TV.")
    else:
        bt = D.branch_tv(traces, window=window)
    bar.update()
    step("interval by W")
    windows = list(interval_windows) if interval_windows is not None else _interval_windows(traces)
    ivw = D.interval_by_window(traces, windows)
    bar.update()
    step("variance check")
    vc = None
    if kind == "residual":
        try:
            vc = D.variance_check(traces)
        except ValueError as exc:
            notes.append(f"Variance check skipped: {exc}")
    bar.update()
    step("plan")
    pres = run_plan(traces, plan, aliases=policy_aliases, window=window, estimates=est, branch=bt,
                    n_resamples=n_resamples, seed=seed)
    bar.update()
    step("decomposition")
    decs = []
    policies = [str(p) for p in traces["policy"].values]
    for a, b in _decomposition_pairs(pres, policies):
        try:
            res = decompose(est, a, b)
        except ValueError as exc:
            notes.append(f"Decomposition {a} vs {b} not computed: {exc}")
            continue
        decs.append((res, res.confidence_interval(level, n_resamples=n_resamples, seed=seed)))
    bar.update()
    bar.close()
    options = {"window": -1 if window is None else int(window), "seed": int(seed),
               "n_resamples": int(n_resamples), "level": float(level),
               "policy_aliases": json.dumps(dict(policy_aliases or {}), sort_keys=True),
               "interval_windows": json.dumps(windows)}
    an = Analysis(traces=traces, plan=plan, estimates=est, aggregate=agg, aggregate_ci=agg_ci, survival=surv,
                  branch_tv=bt, interval=ivw, variance=vc, plan_result=pres, decompositions=decs,
                  notes=notes + pres.notes, options=options)
    an.results = results_dataset(an)
    return an


# ---------------------------------------------------------------------------
# results.nc
# ---------------------------------------------------------------------------

def _prefixed(ds: xr.Dataset, prefix: str) -> xr.Dataset:
    return ds.rename({v: f"{prefix}{v}" for v in ds.data_vars})


def _decomposition_dataset(decs: list[tuple[DecompositionResult, DecompositionInterval]]) -> xr.Dataset:
    if not decs:
        return xr.Dataset()
    parts = []
    for res, ci in decs:
        d = res.to_dataset()
        for name in ("gap", "first", "exposure", "rate"):
            d[f"{name}_low"] = _as_da(getattr(ci.low, name))
            d[f"{name}_high"] = _as_da(getattr(ci.high, name))
        parts.append(d.drop_attrs())
    out = xr.concat(parts, dim="comparison")
    out = out.assign_coords(comparison=[f"{r.a} vs {r.b}" for r, _ in decs],
                            comparison_a=("comparison", [r.a for r, _ in decs]),
                            comparison_b=("comparison", [r.b for r, _ in decs]))
    return _prefixed(out, "decomposition_")


def _clean_attrs(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """netCDF-safe attrs: str, int, float only (bools as int, others as JSON/str)."""
    out = {}
    for k, v in attrs.items():
        if isinstance(v, (bool, np.bool_)):
            out[k] = int(v)
        elif isinstance(v, (int, float, str, np.integer, np.floating)):
            out[k] = v
        else:
            out[k] = json.dumps(v, default=str)
    return out


def results_dataset(an: Analysis) -> xr.Dataset:
    """One Dataset with every reported number; prefixes say where each comes from.

    no prefix: ``estimate`` (doc, policy); ``aggregate_``: ``aggregate``;
    ``aggregate_ci_``: document-bootstrap intervals; ``survival``/``survival_se``
    (step 0..T); ``branch_tv*`` (age); ``interval_`` (window W); ``variance_``
    (variance_check); ``decomposition_`` (comparison); ``plan_`` (hypothesis row;
    ``plan_split`` per doc).
    """
    parts = [an.estimates.drop_attrs(),
             _prefixed(an.aggregate.drop_attrs(), "aggregate_"),
             _prefixed(an.aggregate_ci.drop_attrs(), "aggregate_ci_"),
             an.survival.drop_attrs()]
    if an.branch_tv is not None:
        parts.append(an.branch_tv.drop_attrs())
    if an.interval is not None:
        parts.append(_prefixed(an.interval.drop_attrs(), "interval_").rename(window="interval_window"))
    if an.variance is not None:
        parts.append(_prefixed(an.variance.drop_attrs(), "variance_"))
    parts.append(_decomposition_dataset(an.decompositions))
    pr = an.plan_result
    parts.append(pr.to_dataset().drop_attrs())
    split = pr.split.set_index("doc")
    parts.append(xr.Dataset({"plan_split": ("doc", split.loc[[str(d) for d in an.estimates["doc"].values],
                                                             "split"].to_numpy(dtype=object))},
                            coords={"doc": an.estimates["doc"].values}))
    out = xr.merge(parts, compat="override", join="outer", combine_attrs="drop")
    for name, var in out.data_vars.items():
        var.attrs["status"] = ("plan result: see plan_label for confirmatory/exploratory"
                               if name.startswith("plan_") else "exploratory (descriptive; not in the plan)")
    tr = an.traces.attrs
    out.attrs = _clean_attrs({
        "title": "kvdiv analysis results", "plan_name": an.plan.name, "plan_sha256": an.plan.sha256,
        "plan_source": an.plan.source, "deviations": json.dumps(pr.deviations), "notes": json.dumps(an.notes),
        "exploratory": "every variable except plan_* is descriptive (exploratory); plan_confirmatory marks "
                       "the confirmatory plan rows",
        "kind": tr.get("kind", ""), "horizon": int(tr.get("horizon", 0)), "trace_window": int(tr.get("window", 0)),
        "model": str(tr.get("model", "")), "sampling": str(tr.get("sampling", "")),
        "producer": str(tr.get("producer", "")), "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        **{f"option_{k}": v for k, v in an.options.items()},
    })
    return out


def save_results(results: xr.Dataset, path: str | Path) -> Path:
    """Write results.nc with h5netcdf (strings as variable-length UTF-8)."""
    path = Path(path)
    enc = {}
    for name, var in {**results.data_vars, **results.coords}.items():
        if var.dtype == object:
            enc[name] = {"dtype": str}
    results.to_netcdf(path, engine="h5netcdf", encoding=enc)
    return path


def load_results(path: str | Path) -> xr.Dataset:
    """Read results.nc back (strings decoded)."""
    return xr.load_dataset(path, engine="h5netcdf")


# ---------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------

def fmt(x: Any, digits: int = 4) -> str:
    """Compact number formatting for tables: NaN → '—', ±inf → '±∞'."""
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
    v = float(p)
    if np.isnan(v):
        return "—"
    return f"{v:.2e}" if v < 1e-3 else f"{v:.4f}"


def _ci(lo: Any, hi: Any) -> str:
    return f"[{fmt(lo)}, {fmt(hi)}]"


def plan_rows(pr: PlanResult) -> list[dict[str, str]]:
    """The plan table as display rows (shared by HTML and Markdown)."""
    rows = []
    for r in pr.table.itertuples(index=False):
        comp = f"{r.a} − {r.b}" + (f" ({r.policy})" if r.policy else "") + (f" [{r.window}]" if r.window else "")
        rows.append({
            "id": r.id, "family": r.family, "label": r.label, "metric": r.metric, "comparison": comp,
            "H1": {"less": "A − B < 0", "greater": "A − B > 0"}.get(r.direction, "A − B ≠ 0"),
            "test": r.test, "n docs": str(r.n_docs), "statistic": fmt(r.statistic), "p": fmt_p(r.p_value),
            "p (Holm)" if r.correction == "holm" else "p (adj.)": fmt_p(r.p_adjusted),
            "reject": "yes" if r.reject else "no",
            "effect": f"{fmt(r.effect)} ({'HL' if r.effect_kind == 'hodges_lehmann' else 'mean'})",
            f"{int(round((1 - r.alpha) * 100))}% CI": _ci(r.ci_low, r.ci_high),
            "mean diff [CI]": f"{fmt(r.mean_difference)} {_ci(r.mean_ci_low, r.mean_ci_high)}",
            "deviation": r.deviation or "", "note": r.note or "",
        })
    return rows


def _unify(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    """Same columns for every row (p (Holm) / p (adj.) and CI level may vary)."""
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    return [{c: r.get(c, "") for c in cols} for r in rows]


def estimate_rows(an: Analysis) -> list[dict[str, str]]:
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
                row[q] = f"{fmt(v)} {_ci(ci[q + '_low'].sel(sel), ci[q + '_high'].sel(sel))}"
            rows.append(row)
    return rows


def decomposition_rows(an: Analysis) -> list[dict[str, Any]]:
    rows = []
    for res, ci in an.decompositions:
        keys = list(res.gap["model"].values) if isinstance(res.gap, xr.DataArray) else [None]
        for m in keys:
            g = (lambda x: float(x) if m is None else float(x.sel(model=m)))
            row = {"label": f"{res.a} vs {res.b}" + ("" if m is None else f" ({m})"), "a": res.a, "b": res.b,
                   "n_docs": g(res.n_docs), "M_A": g(res.mismatch_a), "M_B": g(res.mismatch_b)}
            for name in ("gap", "first", "exposure", "rate"):
                row[name] = g(getattr(res, name))
                row[f"{name}_low"] = g(getattr(ci.low, name))
                row[f"{name}_high"] = g(getattr(ci.high, name))
                row[f"{name}_share"] = g(getattr(res.shares, name))
            rows.append(row)
    return rows


def data_summary(ds: xr.Dataset) -> dict[str, str]:
    a = ds.attrs
    models = [str(m) for m in ds["model"].values] if "model" in ds.dims else [str(a.get("model", ""))]
    return {
        "kind": str(a.get("kind", "")), "horizon T": str(a.get("horizon", "")),
        "observed window W": str(a.get("window", "")), "vocabulary": str(a.get("vocab_size", "")),
        "model(s)": ", ".join(m for m in models if m) or "—",
        "documents": str(ds.sizes.get("doc", 0)), "policies": ", ".join(str(p) for p in ds["policy"].values),
        "replicates per (doc, policy)": str(ds.sizes.get("replicate", 0)),
        "sampling": str(a.get("sampling", "")), "producer": str(a.get("producer", "")),
    }


# ---------------------------------------------------------------------------
# Figures and HTML
# ---------------------------------------------------------------------------

def make_figures(an: Analysis) -> dict[str, Any]:
    """Name → matplotlib Figure for every figure the report shows."""
    figs: dict[str, Any] = {"survival": F.survival_figure(an.survival),
                            "decomposition": F.decomposition_figure(an.aggregate)}
    rows = decomposition_rows(an)
    if rows:
        figs["gap"] = F.gap_figure(rows)
    if an.branch_tv is not None:
        figs["branch_tv"] = F.branch_tv_figure(an.branch_tv, an.plan.windows)
    if an.interval is not None and an.interval.sizes.get("window", 0) > 1:
        figs["interval"] = F.interval_figure(an.interval, an.aggregate)
    if an.variance is not None:
        figs["variance"] = F.variance_figure(an.variance)
    return figs


def figure_png(fig, dpi: int = 110) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def _html_table(rows: Sequence[Mapping[str, Any]], cls: str = "") -> str:
    if not rows:
        return "<p><em>none</em></p>"
    rows = _unify([{k: str(v) for k, v in r.items()} for r in rows])
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    body = []
    for r in rows:
        tr_cls = f' class="{html.escape(r.get("label", ""))}"' if "label" in r else ""
        body.append(f"<tr{tr_cls}>" + "".join(f"<td>{html.escape(v)}</td>" for v in r.values()) + "</tr>")
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1200px;color:#222;padding:0 1em}
h1{font-size:1.6em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.8em}
table{border-collapse:collapse;font-size:.85em;margin:.6em 0;display:block;overflow-x:auto}
th,td{border:1px solid #ddd;padding:.25em .5em;text-align:right;white-space:nowrap}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}
tr.confirmatory td{background:#eef7ee}tr.exploratory td{background:#fff8e6}
.badge{display:inline-block;padding:.1em .5em;border-radius:.6em;font-size:.8em;font-weight:600}
.conf{background:#cfe8cf}.expl{background:#ffe3a3}
.note{background:#fff3f3;border-left:4px solid #d62728;padding:.4em .8em;margin:.5em 0}
.meta td{text-align:left}code{background:#f5f5f5;padding:0 .2em}
img{max-width:100%;height:auto;display:block;margin:.6em 0}
"""


def render_html(an: Analysis, figs: Mapping[str, bytes]) -> str:
    pr = an.plan_result
    counts = pr.split["split"].value_counts().to_dict()
    notes = an.notes + [f"Deviation from the plan: {d}" for d in pr.deviations]
    img = lambda k, alt: (f'<img alt="{html.escape(alt)}" src="data:image/png;base64,'  # noqa: E731
                          f'{base64.b64encode(figs[k]).decode()}">' if k in figs else "")
    dec_rows = [{"comparison": r["label"], "n docs": int(r["n_docs"]), "M_A": fmt(r["M_A"]), "M_B": fmt(r["M_B"]),
                 **{f"{n if n == 'gap' else 'Δ' + n} [CI]": f"{fmt(r[n])} {_ci(r[n + '_low'], r[n + '_high'])}"
                    for n in ("gap", "first", "exposure", "rate")},
                 **{f"share {n}": fmt(r[n + '_share'], 3) for n in ("first", "exposure", "rate")}}
                for r in decomposition_rows(an)]
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>kvdiv report — {html.escape(an.plan.name)}</title><style>{_CSS}</style></head><body>",
        f"<h1>kvdiv report: {html.escape(an.plan.name)}</h1>",
        "<table class='meta'>",
        f"<tr><td>plan</td><td>{html.escape(an.plan.source)} — {html.escape(an.plan.description)}</td></tr>",
        f"<tr><td>plan SHA-256</td><td><code>{an.plan.sha256}</code></td></tr>",
        f"<tr><td>split</td><td>salt <code>{html.escape(an.plan.salt)}</code>, confirmatory fraction "
        f"{an.plan.confirmatory_fraction}: {counts.get('confirmatory', 0)} confirmatory, "
        f"{counts.get('exploratory', 0)} exploratory documents</td></tr>",
        *(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in data_summary(an.traces).items()),
        f"<tr><td>options</td><td>{html.escape(', '.join(f'{k}={v}' for k, v in an.options.items()))}</td></tr>",
        "</table>",
        *(f"<div class='note'>{html.escape(n)}</div>" for n in notes),
        "<h2>Plan results</h2>",
        "<p><span class='badge conf'>confirmatory</span> rows are prespecified hypotheses on the confirmatory "
        "split, run exactly as planned; <span class='badge expl'>exploratory</span> rows are anything else "
        "(other splits, or policies substituted after the plan). p (Holm) is adjusted within each family. "
        "Effects are A − B; one-sided tests come with one-sided confidence bounds (±∞ on the open side), so "
        "the interval excludes 0 exactly when the unadjusted test rejects.</p>",
        _html_table(_unify(plan_rows(pr)), "plan"),
        f"<h2>Aggregate estimates <span class='badge expl'>{EXPLORATORY}</span></h2>",
        f"<p>All {an.traces.sizes['doc']} documents, equal document weights; rate = Σ post_mismatch / Σ exposure. "
        f"Brackets: {int(an.options['level'] * 100)}% percentile bootstrap over documents.</p>",
        _html_table(estimate_rows(an)),
        img("decomposition", "decomposition bars"),
        f"<h2>Gap decomposition <span class='badge expl'>{EXPLORATORY}</span></h2>",
        "<p>gap = M_A − M_B = Δfirst + Δexposure + Δrate (Shapley split, docs/statistics.md §3); paired BCa bootstrap "
        "over documents.</p>",
        _html_table(dec_rows), img("gap", "gap attribution"),
        f"<h2>Survival <span class='badge expl'>{EXPLORATORY}</span></h2>", img("survival", "survival curves"),
    ]
    if "branch_tv" in figs:
        parts += [f"<h2>Branch-aligned TV <span class='badge expl'>{EXPLORATORY}</span></h2>",
                  "<p>Shaded: the plan's windows (ages inclusive).</p>", img("branch_tv", "branch-aligned TV")]
    if "interval" in figs:
        parts += [f"<h2>Sharp interval by window <span class='badge expl'>{EXPLORATORY}</span></h2>",
                  img("interval", "sharp interval by W")]
    if an.variance is not None:
        v = an.variance
        vrows = [{"policy": str(p), "median variance ratio": fmt(float(v["variance_ratio"].sel(policy=p).median())),
                  "median efficiency": fmt(float(v["efficiency"].sel(policy=p).median()))}
                 for p in v["policy"].values]
        parts += [f"<h2>Variance check <span class='badge expl'>{EXPLORATORY}</span></h2>",
                  _html_table(vrows), img("variance", "variance check")]
    parts += ["<h2>Reproduce</h2><pre>",
              html.escape(reproduce_snippet(an)), "</pre>", "</body></html>"]
    return "\n".join(parts)


def reproduce_snippet(an: Analysis) -> str:
    w = an.options["window"]
    win = "None" if w == -1 else str(w)
    return (
        "import divstats, protocols\n"
        "from divstats.plans import run_plan\nfrom divstats.decompose import decompose\n"
        "ds = protocols.open_traces(TRACES)\n"
        f"est = divstats.estimate(ds, window={win}); agg = divstats.aggregate(est)\n"
        f"res = run_plan(ds, {an.plan.source!r}, aliases={json.loads(an.options['policy_aliases'])!r}, "
        f"window={win}, seed={an.options['seed']}, n_resamples={an.options['n_resamples']})\n"
        f"dec = decompose(est, A, B); dec.confidence_interval({an.options['level']}, "
        f"n_resamples={an.options['n_resamples']}, seed={an.options['seed']})\n"
    )


def render_markdown(an: Analysis) -> str:
    pr = an.plan_result
    lines = [f"# kvdiv summary: {an.plan.name}", "",
             f"- plan: `{an.plan.source}`", f"- plan SHA-256: `{an.plan.sha256}`"]
    lines += [f"- {k}: {v}" for k, v in data_summary(an.traces).items()]
    lines += [f"- note: {n}" for n in an.notes] + [f"- deviation: {d}" for d in pr.deviations]
    lines += ["", "## Plan results", "", _md_table(_unify(plan_rows(pr))), "",
              f"## Aggregate estimates — {EXPLORATORY}", "", _md_table(estimate_rows(an)), ""]
    dec = decomposition_rows(an)
    if dec:
        lines += [f"## Gap decomposition — {EXPLORATORY}", "", _md_table([
            {"comparison": r["label"], **{n: f"{fmt(r[n])} {_ci(r[n + '_low'], r[n + '_high'])}"
                                          for n in ("gap", "first", "exposure", "rate")}} for r in dec]), ""]
    return "\n".join(lines)


def _md_table(rows: Sequence[Mapping[str, Any]]) -> str:
    if not rows:
        return "_none_"
    cols = list(rows[0])
    esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    out = ["| " + " | ".join(esc(c) for c in cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(esc(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(out)


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------

def analyze(traces: str | Path | xr.Dataset, plan: Plan | str | Path | Mapping[str, Any],
            out_dir: str | Path, *, window: int | None = None, policy_aliases: Mapping[str, str] | None = None,
            seed: int = 0, n_resamples: int = 9999, level: float = 0.95,
            interval_windows: Sequence[int] | None = None, progress: bool = True) -> Analysis:
    """Analyse a traces file (or dataset) under a plan; write report.html, summary.md, results.nc.

    ``policy_aliases`` substitutes data policies for planned ones (a recorded
    deviation; see docs/plans.md). ``seed``/``n_resamples`` control every bootstrap
    and Monte Carlo permutation test.
    """
    if isinstance(traces, xr.Dataset):
        ds = traces
    else:
        from protocols import open_traces

        ds = open_traces(traces)
    an = compute(ds, plan, window=window, policy_aliases=policy_aliases, seed=seed, n_resamples=n_resamples,
                 level=level, interval_windows=interval_windows, progress=progress)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pngs = {k: figure_png(f) for k, f in make_figures(an).items()}
    an.paths["report.html"] = out / "report.html"
    an.paths["report.html"].write_text(render_html(an, pngs), encoding="utf-8")
    an.paths["summary.md"] = out / "summary.md"
    an.paths["summary.md"].write_text(render_markdown(an), encoding="utf-8")
    an.paths["results.nc"] = save_results(an.results, out / "results.nc")
    return an
