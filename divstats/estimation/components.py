"""Variance components: between-document spread and Monte Carlo noise (docs/statistics.md §3-5, §8).

A per-document estimate ``m_d`` of a metric (one document, one policy, R replicates)
varies across documents for two reasons: the documents really differ (the
*between-document* variance ``sigma_B^2``), and each ``m_d`` is a Monte Carlo
mean of R replicates (the *Monte Carlo* variance ``v_d / R``, where ``v_d`` is
the per-replicate variance).  Across documents

    Var(m_d) = sigma_B^2 + E[v_d] / R

so the Monte Carlo part is estimated from the replicates (the squared standard
errors ``estimate`` reports) and the between-document part by subtraction.  What
a study of N documents with R replicates each can resolve follows from the two:
the document mean has variance (sigma_B^2 + E[v_d] / R) / N (see ``divstats.power``).

The same split is made for the paired difference of two policies on the same
documents, where the Monte Carlo variance is v_A / R + v_B / R - 2 c_AB / R.
The covariance c_AB between the policies' replicates is zero when every
(document, policy) request has its own random numbers and positive under common
random numbers (replicate r of every policy drawn from the same seed); it is
estimated from the traces by pairing replicates by index, and taken as zero when
only estimates (no traces) are given.

Every metric's per-replicate value is an *influence value*: a number per
replicate whose replicate mean is the per-document estimate and whose replicate
SD / sqrt(R) is its Monte Carlo SE (for the ratio ``rate`` this is the delta
method's linearisation, as in ``estimate``).
"""

from __future__ import annotations

from itertools import combinations

import numpy as np
import xarray as xr

from divstats.estimands import names
from divstats.traces.arrays import nanmean, without_attrs
from divstats.traces.replicates import replicate_values

__all__ = ["METRICS", "document_values", "paired_document_values", "replicate_influence", "variance_components"]

#: Metrics split into components (the scalar estimands of ``divstats.estimate``).
METRICS: tuple[str, ...] = names(component=True)

_DESCRIPTIONS = {
    "mean": "mean over documents of the per-document estimates",
    "total": "variance across documents of the per-document estimates at the observed R (ddof = 1)",
    "monte_carlo": "Monte Carlo variance of one per-document estimate at the observed R: mean over documents "
                   "of its squared standard error",
    "between": "between-document variance: total - monte_carlo, truncated at 0 (method of moments)",
    "per_replicate": "Monte Carlo variance of a single replicate (mean over documents of R_d * se_d^2); the "
                     "per-document estimate at R replicates has Monte Carlo variance per_replicate / R",
    "replicates": "mean number of replicates per document",
    "n_docs": "documents with a finite estimate (both sides for a pair)",
    "mc_correlation": "Monte Carlo correlation of the two policies' per-document estimates (0 when their "
                      "random numbers are independent; positive under common random numbers)",
}


def _is_traces(data: xr.Dataset) -> bool:
    return not any(name.endswith("_se") for name in data.data_vars)


def replicate_influence(ds: xr.Dataset, window: int | None = None) -> xr.Dataset:
    """Per-replicate influence values of every metric in :data:`METRICS`.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace dataset of any kind (docs/contract.md).
    window : int, optional
        Truncate the observed window as in ``divstats.estimate``.

    Returns
    -------
    xarray.Dataset
        One variable per metric over (doc, policy[, model], replicate).  The replicate
        mean (NaN replicates are absent) is the per-document estimate of
        ``divstats.estimate`` and the replicate SD / sqrt(R) its standard error.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(2, {"a": PolicyEffect(0.1)}, horizon=4, replicates=3)
    >>> replicate_influence(ds)["occurrence"].dims
    ('doc', 'policy', 'replicate')
    """
    rep = replicate_values(ds, window)
    v, T = rep.values, rep.horizon
    occ, post, exposure = v["occurrence"], v["post_mismatch"], v["exposure"]
    loss = occ + post
    out = {"occurrence": occ, "rmtd": v["rmtd"], "exposure": exposure, "post_mismatch": post,
           "loss": loss, "mismatch_fraction": loss / T, "first_mismatch_contribution": occ / T,
           "exposure_contribution": post / T, "window_mismatch": v["window_mismatch"],
           "tail_capacity": v["tail_capacity"], "loss_lower": occ + v["window_mismatch"],
           "loss_upper": occ + v["window_mismatch"] + v["tail_capacity"]}
    mean_post, mean_exp = nanmean(post), nanmean(exposure)
    ok = mean_exp > 0
    safe = np.where(ok, mean_exp, 1.0)[:, None]
    ratio = np.where(ok, mean_post / safe[:, 0], np.nan)[:, None]
    # r + (post - r exposure) / mean(exposure): mean r, SD / sqrt(R) the delta-method SE
    out["rate"] = np.where(ok[:, None], ratio + (post - ratio * exposure) / safe, np.nan)
    lay = rep.layout
    coords = dict(lay.coords)
    if "replicate" in ds.coords:
        coords["replicate"] = ds["replicate"].values
    # plain Variables with the coords attached once: a Dataset of 13 DataArrays aligned them
    # one against another, most of this function's time on small studies
    data = {name: xr.Variable(lay.dims + ("replicate",), np.asarray(out[name]).reshape(lay.shape + (-1,)))
            for name in METRICS}
    return xr.Dataset(data, coords=coords, attrs={"kind": rep.kind, "horizon": T, "window": rep.window})


def document_values(data: xr.Dataset, window: int | None = None) -> xr.Dataset:
    """Per-document estimates, their Monte Carlo variances and replicate counts.

    Parameters
    ----------
    data : xarray.Dataset
        Traces (any kind) or the output of ``divstats.estimate``.
    window : int, optional
        Window truncation, traces only.

    Returns
    -------
    xarray.Dataset
        Over (metric, doc, policy[, model]): ``value`` (the estimate), ``mc_var``
        (its squared Monte Carlo SE) and ``replicates`` (R per document and policy);
        from traces also ``influence`` over ``replicate`` (see :func:`replicate_influence`).

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(4, {"a": PolicyEffect(0.1), "b": PolicyEffect(0.2)}, horizon=5, replicates=3)
    >>> vals = document_values(ds)
    >>> sorted(vals["value"].dims)
    ['doc', 'metric', 'policy']
    """
    if _is_traces(data):
        infl = replicate_influence(data, window).to_dataarray("metric")
        count = infl.notnull().sum("replicate")
        value = infl.mean("replicate", skipna=True)
        var = infl.var("replicate", ddof=1, skipna=True)
        mc_var = (var / count).where(count >= 2)
        out = xr.Dataset({"value": value, "mc_var": mc_var, "replicates": count, "influence": infl})
        return out.assign_attrs(source="traces", kind=str(data.attrs.get("kind", "")))
    metrics = [m for m in METRICS if m in data and m + "_se" in data]
    value = xr.concat([without_attrs(data[m]) for m in metrics], dim="metric").assign_coords(metric=metrics)
    se = xr.concat([without_attrs(data[m + "_se"]) for m in metrics], dim="metric").assign_coords(metric=metrics)
    n = int(data.attrs.get("n_replicates", 0)) or np.nan
    replicates = xr.full_like(value, n, dtype=float)
    return xr.Dataset({"value": value, "mc_var": se ** 2, "replicates": replicates},
                      attrs={"source": "estimates", "kind": str(data.attrs.get("kind", ""))})


def _components(value: xr.DataArray, mc_var: xr.DataArray, replicates: xr.DataArray) -> dict[str, xr.DataArray]:
    ok = value.notnull() & mc_var.notnull()
    value, mc_var, replicates = value.where(ok), mc_var.where(ok), replicates.where(ok)
    n = ok.sum("doc")
    total = value.var("doc", ddof=1, skipna=True).where(n >= 2)
    mc = mc_var.mean("doc", skipna=True)
    return {"mean": value.mean("doc", skipna=True), "total": total, "monte_carlo": mc,
            "between": np.maximum(total - mc, 0.0), "per_replicate": (mc_var * replicates).mean("doc", skipna=True),
            "replicates": replicates.mean("doc", skipna=True), "n_docs": n}


def _pair_mc_cov(vals: xr.Dataset, a: str, b: str) -> xr.DataArray:
    """Monte Carlo covariance of the per-document estimates of policies a and b."""
    if "influence" not in vals:
        return xr.zeros_like(vals["value"].sel(policy=a, drop=True))
    ia, ib = vals["influence"].sel(policy=a, drop=True), vals["influence"].sel(policy=b, drop=True)
    both = ia.notnull() & ib.notnull()
    ia, ib = ia.where(both), ib.where(both)
    k = both.sum("replicate")
    dev = (ia - ia.mean("replicate")) * (ib - ib.mean("replicate"))
    cov = dev.sum("replicate") / (k - 1)
    # the covariance of the two means: replicates paired by index, R_a = R_b = k for the pair
    return (cov / k).where(k >= 2)


def paired_document_values(vals: xr.Dataset, a: str, b: str) -> xr.Dataset:
    """Per-document difference A - B of every metric with its Monte Carlo variance.

    Parameters
    ----------
    vals : xarray.Dataset
        The output of :func:`document_values`.
    a, b : str
        Policy ids.

    Returns
    -------
    xarray.Dataset
        Over (metric, doc[, model]): ``value`` (A - B), ``mc_var`` (var_A + var_B -
        2 cov_AB, the covariance from replicates paired by index when ``vals`` came
        from traces, else 0), ``mc_cov`` and ``replicates`` (mean of the two R).

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(4, {"a": PolicyEffect(0.1), "b": PolicyEffect(0.2)}, horizon=5, replicates=3)
    >>> pair = paired_document_values(document_values(ds), "a", "b")
    >>> pair["value"].sizes["doc"]
    4
    """
    pick = lambda name, p: vals[name].sel(policy=p, drop=True)  # noqa: E731
    cov = _pair_mc_cov(vals, a, b)
    return xr.Dataset({"value": pick("value", a) - pick("value", b),
                       "mc_var": pick("mc_var", a) + pick("mc_var", b) - 2 * cov, "mc_cov": cov,
                       "replicates": (pick("replicates", a) + pick("replicates", b)) / 2})


def _pairs(vals: xr.Dataset) -> xr.Dataset:
    policies = [str(p) for p in vals["policy"].values]
    parts, labels = [], []
    for a, b in combinations(policies, 2):
        pair = paired_document_values(vals, a, b)
        comp = _components(pair["value"], pair["mc_var"], pair["replicates"])
        ma, mb = vals["mc_var"].sel(policy=a, drop=True), vals["mc_var"].sel(policy=b, drop=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            comp["mc_correlation"] = (pair["mc_cov"] / np.sqrt(ma * mb)).mean("doc", skipna=True)
        parts.append(xr.Dataset(comp))
        labels.append((a, b))
    if not parts:
        return xr.Dataset()
    out = xr.concat(parts, dim="pair")
    out = out.assign_coords(pair=[f"{a} - {b}" for a, b in labels], pair_a=("pair", [a for a, _ in labels]),
                            pair_b=("pair", [b for _, b in labels]))
    return out.rename({k: f"diff_{k}" for k in out.data_vars})


def variance_components(data: xr.Dataset, window: int | None = None) -> xr.Dataset:
    """Split each per-document metric's spread into between-document and Monte Carlo variance.

    Parameters
    ----------
    data : xarray.Dataset
        Traces of any kind (the Monte Carlo covariance between policies is then
        estimated from replicates paired by index, which matters under common random
        numbers), or the output of ``divstats.estimate`` (policies are then taken to
        have independent random numbers).
    window : int, optional
        Window truncation as in ``divstats.estimate`` (traces only).

    Returns
    -------
    xarray.Dataset
        Over (metric, policy[, model]): ``mean``, ``total``, ``monte_carlo``,
        ``between``, ``per_replicate``, ``replicates``, ``n_docs``; over (metric,
        pair[, model]) the same for the paired difference ``A - B`` prefixed ``diff_``
        plus ``diff_mc_correlation``.  ``pair_a``/``pair_b`` name the two policies.
        A per-document estimate at R replicates has variance across documents
        ``between + per_replicate / R``.

    Raises
    ------
    ValueError
        ``window`` given with estimates (they were computed with their own window).

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(6, {"a": PolicyEffect(0.1), "b": PolicyEffect(0.3)}, horizon=5, replicates=4)
    >>> vc = variance_components(ds)
    >>> float(vc["between"].sel(metric="occurrence", policy="a")) >= 0
    True
    """
    if window is not None and not _is_traces(data):
        raise ValueError("window applies to traces; estimates were already computed with their window")
    vals = document_values(data, window)
    comp = xr.Dataset(_components(vals["value"], vals["mc_var"], vals["replicates"]))
    out = xr.merge([comp, _pairs(vals)], combine_attrs="drop")
    for name in list(out.data_vars):
        base = name.removeprefix("diff_")
        desc = _DESCRIPTIONS[base]
        out[name].attrs["description"] = desc if name == base else f"paired difference A - B: {desc}"
    kind = str(vals.attrs.get("kind", ""))
    return out.assign_attrs(
        source=vals.attrs["source"], kind=kind,
        model="Var(per-document estimate at R replicates) = between + per_replicate / R",
        mc_covariance=("estimated from replicates paired by index" if vals.attrs["source"] == "traces"
                       else "assumed 0 (estimates only: independent random numbers per policy)"))
