"""Figures for the report (matplotlib, Agg canvas). Each function returns a Figure.

What every figure shares (the Agg canvas, panels per model, the colours, the band over
documents: the document mean ± z · SD_docs / √n_docs) is :mod:`divstats.report.plotting`;
here is what each figure shows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr
from matplotlib.figure import Figure
from scipy import stats

from divstats.estimands import (
    EXPOSURE_CONTRIBUTION,
    FIRST_MISMATCH_CONTRIBUTION,
    MISMATCH_FRACTION,
    TAIL_CAPACITY,
    TOKENS_PER_CALL,
    WINDOW_MISMATCH,
)
from divstats.inference.decompose import PARTS
from divstats.report.plotting import (
    PALETTE,
    add_legend,
    doc_band,
    model_values,
    new_figure,
    panel_row,
    policy_colors,
    set_title,
)

__all__ = [
    "margin_figure",
    "branch_tv_figure", "decomposition_figure", "gap_figure", "interval_figure", "logit_figure",
    "speculative_figure", "survival_figure", "variance_figure"
]

_WINDOW_COLORS = ("#9ecae1", "#fdae6b", "#a1d99b", "#d9d9d9")


def survival_figure(surv: xr.Dataset, *, level: float = 0.95) -> Figure:
    """Survival S(t) = P(tau > t) per policy, document mean with a band (docs/statistics.md §3).

    Parameters
    ----------
    surv : xarray.Dataset
        ``divstats.survival(ds)``.
    level : float
        Band level.

    Returns
    -------
    matplotlib.figure.Figure
        One panel per model.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(4, {"a": PolicyEffect(0.1), "b": PolicyEffect(0.3)}, horizon=5, replicates=4)
    >>> import divstats
    >>> len(survival_figure(divstats.survival(ds)).axes)
    1
    """
    models = model_values(surv)
    fig, axes = panel_row(len(models))
    colors = policy_colors(surv["policy"].values)
    step = surv["step"].values
    for ax, model in zip(axes, models, strict=True):
        sub = surv if model is None else surv.sel(model=model)
        for pol in sub["policy"].values:
            s = sub.sel(policy=pol)
            mean, lo, hi = doc_band(s["survival"], s.get("survival_se"), level)
            c = colors[str(pol)]
            ax.step(step, mean, where="post", color=c, lw=1.8, label=str(pol))
            ax.fill_between(step, lo.clip(0, 1), hi.clip(0, 1), step="post", color=c, alpha=0.18, lw=0)
        ax.set_xlabel("step t")
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlim(step.min(), step.max())
        ax.grid(alpha=0.3)
        set_title(ax, "Survival: P(no mismatch up to t)", model)
        add_legend(ax, sub.sizes["policy"])
    axes[0].set_ylabel(f"S(t), document mean, {int(level * 100)}% band")
    return fig


def decomposition_figure(agg: xr.Dataset, *, level: float = 0.95) -> Figure:
    """Mismatch fraction per policy split into first mismatch + exposure × rate.

    Error bars: the total's document-level interval (mean ± z·SD_docs/√n). When the
    post-divergence part is not identified (finite window), the identified window
    part is drawn solid and the tail capacity as a hatched range (the sharp interval).

    Parameters
    ----------
    agg : xarray.Dataset
        ``divstats.aggregate(est)``.
    level : float
        Error-bar level.

    Returns
    -------
    matplotlib.figure.Figure
        One panel per model.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(4, {"a": PolicyEffect(0.1), "b": PolicyEffect(0.3)}, horizon=5, replicates=4)
    >>> import divstats
    >>> len(decomposition_figure(divstats.aggregate(divstats.estimate(ds))).axes)
    1
    """
    models = model_values(agg)
    fig, axes = panel_row(len(models), height=max(2.6, 0.55 * agg.sizes["policy"] + 1.8))
    z = stats.norm.ppf(0.5 + level / 2)
    n_docs = int(agg.attrs.get("n_docs", 1))
    T = float(agg.attrs.get("horizon", 1))
    for ax, model in zip(axes, models, strict=True):
        sub = agg if model is None else agg.sel(model=model)
        pols = [str(p) for p in sub["policy"].values]
        y = np.arange(len(pols))
        first = sub[FIRST_MISMATCH_CONTRIBUTION].values
        expo = sub[EXPOSURE_CONTRIBUTION].values
        ax.barh(y, first, color="#4c72b0", label="first mismatch (occurrence / T)")
        identified = np.isfinite(expo)
        if identified.any():
            ax.barh(y[identified], expo[identified], left=first[identified], color="#dd8452",
                    label="after divergence (exposure / T × rate)")
        if (~identified).any():
            win = (sub[WINDOW_MISMATCH].values / T)[~identified]
            tail = (sub[TAIL_CAPACITY].values / T)[~identified]
            ax.barh(y[~identified], win, left=first[~identified], color="#dd8452")
            ax.barh(y[~identified], tail, left=first[~identified] + win, color="none",
                    edgecolor="#dd8452", hatch="///", label="unobserved tail (sharp interval)")
        total = sub[MISMATCH_FRACTION].values
        if f"{MISMATCH_FRACTION}_sd_docs" in sub and n_docs > 1:
            half = z * sub[f"{MISMATCH_FRACTION}_sd_docs"].values / np.sqrt(n_docs)
        else:
            half = z * sub[f"{MISMATCH_FRACTION}_se"].values
        ok = np.isfinite(total)
        ax.errorbar(total[ok], y[ok], xerr=half[ok], fmt="none", ecolor="black", capsize=3, lw=1)
        ax.set_yticks(y, pols)
        ax.invert_yaxis()
        ax.set_xlabel("mismatch fraction (expected share of the T tokens that differ)")
        ax.grid(axis="x", alpha=0.3)
        set_title(ax, "Where the mismatches come from", model)
    handles, labels = axes[0].get_legend_handles_labels()
    if labels:
        fig.legend(handles, labels, loc="outside lower center", ncols=min(2, len(labels)), fontsize=8, frameon=False)
    return fig


def gap_figure(rows: Sequence[Mapping[str, Any]]) -> Figure:
    """Gap M_A − M_B and its Shapley parts with bootstrap intervals, one group per comparison.

    ``rows``: dicts with ``label`` and, for each of gap/first/exposure/rate, the
    value and ``<name>_low``/``<name>_high`` (as in the report's decomposition table).

    Parameters
    ----------
    rows : sequence of mapping
        As described above.

    Returns
    -------
    matplotlib.figure.Figure
        Horizontal bars with interval whiskers.

    Examples
    --------
    >>> row = {"label": "a vs b", **{k: 0.1 for k in ("gap", "first", "exposure", "rate")},
    ...        **{f"{k}_{e}": 0.1 for k in ("gap", "first", "exposure", "rate") for e in ("low", "high")}}
    >>> len(gap_figure([row]).axes) >= 1
    True
    """
    # the decomposition's PARTS (gap, first, exposure, rate; named after the estimands they vary), gap drawn last
    style = dict(zip(PARTS, (("gap (total)", "#333333"), ("Δ first mismatch", "#4c72b0"), ("Δ exposure", "#dd8452"),
                             ("Δ rate", "#55a868")), strict=True))
    parts = [(name, *style[name]) for name in (*PARTS[1:], PARTS[0])]
    n = max(len(rows), 1)
    fig = new_figure(7.2, 0.9 * n + 1.6)
    ax = fig.subplots()
    height = 0.8 / len(parts)
    for i, row in enumerate(rows):
        for j, (name, label, color) in enumerate(parts):
            yy = i + (j - (len(parts) - 1) / 2) * height
            v = row[name]
            err = [[v - row.get(f"{name}_low", v)], [row.get(f"{name}_high", v) - v]]
            ax.barh(yy, v, height=height * 0.9, color=color, label=label if i == 0 else None)
            if np.all(np.isfinite(err)):
                ax.errorbar(v, yy, xerr=err, fmt="none", ecolor="black", capsize=2, lw=0.8)
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(range(len(rows)), [str(r["label"]) for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("contribution to M_A − M_B (mismatch fraction)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title("Gap attribution (Shapley) with paired bootstrap intervals", fontsize=11)
    if ax.get_legend_handles_labels()[0]:
        fig.legend(loc="outside lower center", ncols=4, fontsize=8, frameon=False)
    return fig


def branch_tv_figure(bt: xr.Dataset, windows: Mapping[str, tuple[int, int]] | None = None,
                     *, level: float = 0.95) -> Figure:
    """Branch-aligned TV by age since divergence, with the plan's windows shaded.

    Parameters
    ----------
    bt : xarray.Dataset
        ``divstats.branch_tv(ds)``.
    windows : mapping of str to (int, int), optional
        Named inclusive age ranges to shade (a plan's ``windows``).
    level : float
        Band level.

    Returns
    -------
    matplotlib.figure.Figure
        One panel per model.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(4, {"a": PolicyEffect(0.1), "b": PolicyEffect(0.3)}, horizon=5, replicates=4)
    >>> import divstats
    >>> len(branch_tv_figure(divstats.branch_tv(ds), {"early": (1, 2)}).axes)
    1
    """
    models = model_values(bt)
    fig, axes = panel_row(len(models))
    colors = policy_colors(bt["policy"].values)
    age = bt["age"].values
    for ax, model in zip(axes, models, strict=True):
        sub = bt if model is None else bt.sel(model=model)
        for k, (name, (first, last)) in enumerate((windows or {}).items()):
            ax.axvspan(first - 0.5, min(last, age.max()) + 0.5, color=_WINDOW_COLORS[k % 4], alpha=0.35, lw=0)
            ax.text((first + min(last, age.max())) / 2, 0.98, f"{name}\n[{first}, {last}]", ha="center",
                    va="top", fontsize=8, transform=ax.get_xaxis_transform())
        for pol in sub["policy"].values:
            s = sub.sel(policy=pol)
            mean, lo, hi = doc_band(s["branch_tv"], s.get("branch_tv_se"), level)
            ok = np.isfinite(mean.values)
            c = colors[str(pol)]
            ax.plot(age[ok], mean.values[ok], color=c, lw=1.6, marker="o", ms=2.5, label=str(pol))
            ax.fill_between(age[ok], lo.values[ok].clip(0), hi.values[ok].clip(max=1), color=c, alpha=0.15, lw=0)
        ax.set_xlabel("age k = t − τ (steps since divergence)")
        ax.grid(alpha=0.3)
        set_title(ax, "Branch-aligned TV", model)
        add_legend(ax, sub.sizes["policy"])
    axes[0].set_ylim(bottom=0)  # after all panels (shared y)
    axes[0].set_ylabel(f"E[TV at age k], document mean, {int(level * 100)}% band")
    return fig


def logit_figure(lc: xr.Dataset, bt: xr.Dataset) -> Figure:
    """KL beside TV: branch TV, KL in both directions (with Pinsker's floor) by age, entropies by step.

    Three panels, each the document mean per policy: the branch-aligned TV by age; KL(P‖Q)
    (solid) and KL(Q‖P) (dashed) by age with the floor 2·TV² of the TV curve (dotted: by
    Pinsker and Jensen a mean KL at an age is at least twice the squared mean TV there, both
    weighted alike); H(P) (solid) and H(Q) (dashed) by step. Ages whose mean KL is infinite
    are left out. The first model only, for traces combined across models.

    Parameters
    ----------
    lc : xarray.Dataset
        ``divstats.logit_curves(ds)``.
    bt : xarray.Dataset
        ``divstats.branch_tv(ds)`` of the same traces.

    Returns
    -------
    matplotlib.figure.Figure

    Raises
    ------
    KeyError
        ``lc`` lacks the logit curves.

    Examples
    --------
    >>> import divstats
    >>> from protocols.examples import example_dataset
    >>> ds = example_dataset("residual", top_logprobs=2, horizon=6)
    >>> len(logit_figure(divstats.logit_curves(ds), divstats.branch_tv(ds)).axes)
    3
    """
    if "model" in lc.dims:
        lc, bt = lc.isel(model=0), bt.isel(model=0)
    fig, (ax_tv, ax_kl, ax_h) = panel_row(3, width=4.6, height=3.8, sharey=False)
    colors = policy_colors(lc["policy"].values)
    age, step = lc["age"].values, lc["step"].values
    for pol in lc["policy"].values:
        c = colors[str(pol)]
        tv = bt["branch_tv"].sel(policy=pol).mean("doc").values
        ok = np.isfinite(tv)
        ax_tv.plot(age[ok], tv[ok], color=c, marker="o", ms=2.5, lw=1.6, label=str(pol))
        ax_kl.plot(age[ok], 2 * tv[ok] ** 2, color=c, ls=":", lw=1.2)
        for name, ls in (("kl_pq", "-"), ("kl_qp", "--")):
            kl = lc[f"logit_{name}_by_age"].sel(policy=pol).mean("doc").values
            ok = np.isfinite(kl)
            ax_kl.plot(age[ok], kl[ok], color=c, ls=ls, marker="o", ms=2.0, lw=1.4)
        for name, ls in (("entropy_p", "-"), ("entropy_q", "--")):
            h = lc[f"logit_{name}_by_step"].sel(policy=pol).mean("doc").values
            ok = np.isfinite(h)
            ax_h.plot(step[ok], h[ok], color=c, ls=ls, lw=1.4)
    ax_tv.set(xlabel="age k = t − τ", ylabel="E[TV at age k]", title="Branch-aligned TV")
    ax_kl.set(xlabel="age k = t − τ", ylabel="nats", title="KL(P‖Q) —, KL(Q‖P) --, 2·TV² ···")
    ax_h.set(xlabel="step t", ylabel="nats", title="Entropy H(P) —, H(Q) --")
    for ax in (ax_tv, ax_kl, ax_h):
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    add_legend(ax_tv, lc.sizes["policy"])
    return fig


def interval_figure(ivw: xr.Dataset, full: xr.Dataset | None = None) -> Figure:
    """Sharp interval for the mismatch fraction as a function of the window W (docs/statistics.md §6).

    ``ivw``: ``divstats.interval_by_window(ds, windows)``; per-document bounds are
    averaged over documents (equal weights, as the aggregate). ``full``: the
    aggregate at the full horizon, drawn dotted where the loss is identified.

    Parameters
    ----------
    ivw : xarray.Dataset
        ``divstats.interval_by_window(ds, windows)``.
    full : xarray.Dataset, optional
        ``divstats.aggregate(est)`` at the full horizon.

    Returns
    -------
    matplotlib.figure.Figure
        One panel per model.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(4, {"a": PolicyEffect(0.1), "b": PolicyEffect(0.3)}, horizon=5, replicates=4)
    >>> import divstats
    >>> len(interval_figure(divstats.interval_by_window(ds, [0, 2, 4])).axes)
    1
    """
    curve = ivw.mean("doc") if "doc" in ivw.dims else ivw
    models = model_values(curve)
    fig, axes = panel_row(len(models))
    colors = policy_colors(curve["policy"].values)
    w = curve["window"].values
    for ax, model in zip(axes, models, strict=True):
        sub = curve if model is None else curve.sel(model=model)
        for pol in sub["policy"].values:
            s = sub.sel(policy=pol)
            c = colors[str(pol)]
            lo, hi = s[f"{MISMATCH_FRACTION}_lower"].values, s[f"{MISMATCH_FRACTION}_upper"].values
            ax.fill_between(w, lo, hi, color=c, alpha=0.22, lw=0)
            ax.plot(w, lo, color=c, lw=1.4, marker="o", ms=3, label=f"{pol}")
            ax.plot(w, hi, color=c, lw=1.4, ls="--", marker="o", ms=3)
            if full is not None:
                f = full.sel(policy=pol) if model is None else full.sel(policy=pol, model=model)
                if np.isfinite(float(f[MISMATCH_FRACTION])):
                    ax.axhline(float(f[MISMATCH_FRACTION]), color=c, lw=0.9, ls=":")
        ax.set_xlabel("observation window W (steps observed after divergence)")
        ax.grid(alpha=0.3)
        set_title(ax, "Sharp interval for the mismatch fraction", model)
        add_legend(ax, sub.sizes["policy"])
    # After every panel is drawn: fixing a limit inside the loop would freeze the
    # shared y-range at the first panel's data.
    axes[0].set_ylim(bottom=0)
    axes[0].set_ylabel("lower (solid) – upper (dashed); full value dotted")
    return fig


def variance_figure(vc: xr.Dataset, *, residual: str = "var_residual",
                    crude: str = "var_crude_implied") -> Figure:
    """Residual-branch vs implied crude variance per (document, policy), log–log.

    Points below the diagonal are variance reductions (docs/statistics.md §5 guarantees ≤).

    Parameters
    ----------
    vc : xarray.Dataset
        ``divstats.variance_check(ds)``.
    residual, crude : str
        The variables plotted on the y and x axes.

    Returns
    -------
    matplotlib.figure.Figure
        A log–log scatter with the diagonal.

    Examples
    --------
    >>> import divstats
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(3, {"a": PolicyEffect(0.2)}, horizon=5, replicates=4, kind="residual")
    >>> len(variance_figure(divstats.variance_check(ds)).axes)
    1
    """
    fig = new_figure(6.0, 5.0)
    ax = fig.subplots()
    colors = policy_colors(vc["policy"].values)
    lo_all, hi_all = np.inf, 0.0
    for pol in vc["policy"].values:
        s = vc.sel(policy=pol)
        x = np.asarray(s[crude].values, dtype=float).ravel()
        y = np.asarray(s[residual].values, dtype=float).ravel()
        ok = np.isfinite(x) & np.isfinite(y) & (x > 0) & (y > 0)
        if ok.any():
            ax.scatter(x[ok], y[ok], s=14, color=colors[str(pol)], alpha=0.8, label=str(pol))
            lo_all, hi_all = min(lo_all, x[ok].min(), y[ok].min()), max(hi_all, x[ok].max(), y[ok].max())
    if np.isfinite(lo_all) and hi_all > 0:
        ax.plot([lo_all, hi_all], [lo_all, hi_all], color="black", lw=0.8, label="equal variance")
        ax.set_xscale("log")
        ax.set_yscale("log")
    else:
        ax.text(0.5, 0.5, "no positive variances to show", ha="center", transform=ax.transAxes)
    ax.set_xlabel("implied crude variance (per replicate)")
    ax.set_ylabel("residual-branch variance (per replicate)")
    ax.grid(alpha=0.3, which="both")
    ax.set_title("Variance check: residual branch vs crude", fontsize=11)
    add_legend(ax, vc.sizes.get("policy", 0))
    return fig


def margin_figure(table: Any) -> Figure:
    """Each test at a margin: the mean difference's interval against its margins, one row per hypothesis.

    The interval is the one the test decides by — (1 − 2α) for equivalence (inside
    the dashed margins ±δ exactly when equivalence is declared), the one-sided
    (1 − α) bound for non-inferiority (an arrow on the open side; the margin on the
    worse side).  Refused rows show the point estimate hollow, with the reason.

    Parameters
    ----------
    table : pandas.DataFrame
        ``run_plan(...).table`` rows with direction "equivalence" or "noninferiority".

    Returns
    -------
    matplotlib.figure.Figure
        One panel per row, each on its own scale.

    Examples
    --------
    >>> import pandas as pd
    >>> t = pd.DataFrame([{"id": "E", "a": "x", "b": "full", "metric": "occurrence", "direction": "equivalence",
    ...                    "margin": 0.05, "worse": "", "mean_difference": 0.01, "ci_low": -0.02,
    ...                    "ci_high": 0.03, "verdict": "equivalent within ±0.05", "n_docs": 60}])
    >>> len(margin_figure(t).axes)
    1
    """
    rows = list(table.itertuples(index=False))
    fig = new_figure(7.2, 0.85 * max(len(rows), 1) + 1.0)
    axes = fig.subplots(max(len(rows), 1), 1, squeeze=False)[:, 0]
    for ax, r in zip(axes, rows, strict=False):
        d, lo, hi = float(r.mean_difference), float(r.ci_low), float(r.ci_high)
        if r.direction == "equivalence":
            lines = [-r.margin, r.margin]
        else:
            lines = [r.margin if r.worse == "larger" else -r.margin]
        span = max([abs(x) for x in lines + [d, lo, hi] if np.isfinite(x)] + [1e-9]) * 1.3
        for x in lines:
            ax.axvline(x, color="#c44e52", ls="--", lw=1)
        ax.axvline(0, color="black", lw=0.6)
        refused = not (np.isfinite(r.ci_low) or np.isfinite(r.ci_high)) or np.isnan(lo) or np.isnan(hi)
        if refused:
            if np.isfinite(d):
                ax.plot([d], [0], "o", mfc="white", mec="#555555")
        else:
            a, b = (lo if np.isfinite(lo) else -span), (hi if np.isfinite(hi) else span)
            ax.plot([a, b], [0, 0], color="#4c72b0", lw=3, solid_capstyle="butt")
            if not np.isfinite(lo):
                ax.annotate("", (-span, 0), (-span * 0.8, 0), arrowprops={"arrowstyle": "->", "color": "#4c72b0"})
            if not np.isfinite(hi):
                ax.annotate("", (span, 0), (span * 0.8, 0), arrowprops={"arrowstyle": "->", "color": "#4c72b0"})
            ax.plot([d], [0], "o", color="#4c72b0")
        ax.set_xlim(-span, span)
        ax.set_yticks([])
        ax.set_title(f"{r.id}: {r.metric}, {r.a} − {r.b} — "
                     f"{r.verdict if not refused else f'refused (n = {r.n_docs})'}", fontsize=8, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("mean difference A − B with the test's interval; dashed: the margin(s)")
    return fig


def speculative_figure(agg: xr.Dataset, *, level: float = 0.95) -> Figure:
    """Tokens per target call against γ per policy, and the speedup where a cost ratio was given.

    Error bars are the intervals over documents of
    ``divstats.aggregate_speculative``; where those were refused (too few documents)
    they are ± z · the Monte Carlo SE given the documents, and the axis says so.

    Parameters
    ----------
    agg : xarray.Dataset
        ``divstats.aggregate_speculative(divstats.speculative(ds, ...))`` over (policy, gamma).
    level : float
        Level of the fallback bars.

    Returns
    -------
    matplotlib.figure.Figure
        One panel (tokens per call), two with ``speedup`` (best γ ringed).

    Examples
    --------
    >>> import numpy as np, divstats
    >>> ds = divstats.simulate(lambda h: np.array([0.6, 0.4]), lambda h: np.array([0.5, 0.5]), 2, 6, 20,
    ...                        kind="reference")
    >>> agg = divstats.aggregate_speculative(divstats.speculative(ds, cost_ratio=0.1), n_resamples=99)
    >>> len(speculative_figure(agg).axes)
    2
    """
    panels = [TOKENS_PER_CALL] + (["speedup"] if "speedup" in agg else [])
    models = model_values(agg)
    # one row of panels per model (the demo studies two): each model's drafts against its own P
    fig = new_figure(6.4 * len(panels) if len(panels) > 1 else 6.4, 4.2 * len(models))
    grid = fig.subplots(len(models), len(panels), sharey=False, squeeze=False)
    colors = policy_colors(agg["policy"].values)
    g = agg["gamma"].values
    z = stats.norm.ppf(0.5 + level / 2)
    for row, model in zip(grid, models, strict=True):
        one = agg if model is None else agg.sel(model=model)
        _speculative_panels(list(row), panels, one, model, colors, g, z, level)
    return fig


def _speculative_panels(axes: list, panels: list[str], agg: xr.Dataset, model: Any, colors: dict[str, str],
                        g: np.ndarray, z: float, level: float) -> None:
    """One model's speculative panels (tokens per call; speedup with the best γ ringed)."""
    for ax, q in zip(axes, panels, strict=True):
        refused = bool(np.isnan(agg[q + "_low"].values).all())
        for k, pol in enumerate(agg["policy"].values):
            s = agg.sel(policy=pol)
            y = s[q].values
            lo, hi = ((y - z * s[q + "_se"].values, y + z * s[q + "_se"].values) if refused
                      else (s[q + "_low"].values, s[q + "_high"].values))
            # a small sideways offset per policy keeps overlapping bars apart
            x = g + (k - (agg.sizes["policy"] - 1) / 2) * 0.08
            c = colors[str(pol)]
            ax.errorbar(x, y, yerr=[y - lo, hi - y], color=c, marker="o", ms=4, lw=1.4, capsize=3, label=str(pol))
            if q == "speedup" and "best_gamma" in agg:
                b = int(s["best_gamma"])
                if b in g:
                    i = int(np.flatnonzero(g == b)[0])
                    ax.plot(x[i], y[i], "o", ms=11, mfc="none", mec=c, mew=1.6)
        if q == "speedup":
            ax.axhline(1.0, color="0.4", lw=0.9, ls=":")
            ax.set_ylabel(f"speedup at c = {float(agg.attrs['cost_ratio']):g} (best γ ringed)")
        else:
            ax.set_ylabel("tokens per target call")
        band = f"± {z:.2f} MC SE (intervals refused)" if refused else f"{int(level * 100)}% interval over documents"
        ax.set_xlabel(f"γ, drafts per call (bars: {band})")
        ax.set_xticks(g)
        ax.grid(alpha=0.3)
        set_title(ax, "Speculative decoding with the policy as draft" if q != "speedup" else "Speedup", model)
        add_legend(ax, agg.sizes["policy"])


def pareto_front(kept: np.ndarray, value: np.ndarray, worse: str = "larger") -> np.ndarray:
    """Indices of the points no other point beats on both KV kept (less is better) and value.

    Examples
    --------
    >>> pareto_front(np.array([0.9, 0.5, 0.5, 0.3]), np.array([0.01, 0.02, 0.05, 0.2])).tolist()
    [0, 1, 3]
    """
    v = value if worse == "larger" else -value
    ok = np.isfinite(kept) & np.isfinite(v)
    front = []
    for i in np.flatnonzero(ok):
        beaten = ok & (kept <= kept[i]) & (v <= v[i]) & ((kept < kept[i]) | (v < v[i]))
        if not beaten.any():
            front.append(i)
    return np.array(sorted(front, key=lambda i: -kept[i]), dtype=int)


def compression_figure(curves: xr.Dataset, certified: Mapping[tuple[str, Any], str] | None = None) -> Figure:
    """Each family's curve against KV kept, with its simultaneous band, the margin and the certified budget.

    Parameters
    ----------
    curves : xarray.Dataset
        :func:`divstats.estimation.budget_curves.budget_curves` (with ``margin`` and
        ``reference_level`` in its attrs when a certification set them).
    certified : mapping, optional
        (family, model) -> the certified policy id ("" for none): marked with a star.

    Returns
    -------
    matplotlib.figure.Figure
        One panel per model: lines with pointwise error bars, the shaded band, the
        dashed margin (reference + margin), stars at certified budgets, and the grey
        Pareto front of all the methods' points.
    """
    models = model_values(curves)
    fig, axes = panel_row(len(models), 6.8, 4.4)
    fams = [str(f) for f in curves["family"].values]
    colors = {f: PALETTE[i % len(PALETTE)] for i, f in enumerate(fams)}
    metric, worse = curves.attrs.get("metric", ""), curves.attrs.get("worse", "larger")
    line = float(curves.attrs.get("reference_level", np.nan)) + float(curves.attrs.get("margin", np.nan))
    for ax, m in zip(axes, models, strict=True):
        one = curves.sel(model=m) if m is not None else curves
        pts_k, pts_v = [], []
        for f in fams:
            c = one.sel(family=f)
            k, y = c["kept"].values, c["mean"].values
            ok = np.isfinite(k) & np.isfinite(y)
            ax.fill_between(k[ok], c["band_low"].values[ok], c["band_high"].values[ok], color=colors[f], alpha=0.15,
                            lw=0)
            err = np.vstack([y - c["low"].values, c["high"].values - y])[:, ok]
            ax.errorbar(k[ok], y[ok], yerr=np.where(np.isfinite(err), err, 0), color=colors[f], marker="o",
                        ms=4, capsize=2, label=f)
            pts_k += list(k[ok])
            pts_v += list(y[ok])
            star = (certified or {}).get((f, None if m is None else str(m)), "")
            if star:
                j = [str(p) for p in c["policy"].values].index(star)
                ax.plot([k[j]], [y[j]], marker="*", ms=16, color=colors[f], mec="black", zorder=5)
        if pts_k:
            front = pareto_front(np.array(pts_k), np.array(pts_v), worse)
            ax.plot(np.array(pts_k)[front], np.array(pts_v)[front], color="#777777", lw=1, ls=":",
                    label="Pareto front")
        if np.isfinite(line):
            ax.axhline(line, color="#c44e52", ls="--", lw=1, label="margin")
        ax.invert_xaxis()
        ax.set_xlabel("KV kept (fraction of the prompt cache) → more compression")
        ax.set_ylabel(f"mean {metric} over documents")
        ax.grid(alpha=0.3)
        set_title(ax, "How much can I compress?", m)
        add_legend(ax, len(fams) + 2)
    return fig
