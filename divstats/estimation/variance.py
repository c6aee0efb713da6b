"""Variance dominance of the residual-branch estimator, demonstrated per document (docs/statistics.md §5).

The crude total loss has the law of B (1 + R_{t*}) with B ~ Bernoulli(1 - S_T)
independent of the branch; the residual-branch value (1 - S_T)(1 + R_{t*}) is its
conditional expectation given (Z, t*, branch).  Hence

    Var(crude) = Var(residual) + E[(1 - S_T) S_T (1 + R_{t*})^2],

and the reduction term is estimable from the same replicates.
"""

from __future__ import annotations

import warnings

import numpy as np
import xarray as xr

from divstats.traces.arrays import core_array, mean_se, nanmean, row_chunks
from divstats.traces.chunked import map_docs
from divstats.traces.replicates import replicate_values, survival_terms
from protocols import Kind
from protocols.chunks import is_lazy

__all__ = ["variance_check"]


def _arviz():
    # arviz prints a FutureWarning about its refactor on import; it is not ours to act on.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        import arviz  # lazy: arviz is heavy and only variance_check uses it
    return arviz


#: Fewest replicates for the ESS and MCSE (arviz's minimum draws for one chain); below, NaN.
MIN_DIAGNOSTIC_DRAWS = 4


def _mc_diagnostics(values: np.ndarray, present: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ESS and MCSE of the mean of per-replicate values (rows, n), via arviz (one chain).

    Rows with padded (absent) replicates are compacted, keeping replicate order, and
    handed to arviz in groups of equal length.
    """
    az = _arviz()
    order = np.argsort(~present, axis=1, kind="stable")     # present replicates first
    compact = np.take_along_axis(values, order, axis=1)
    counts = present.sum(axis=1)
    ess = np.full(len(values), np.nan)
    mcse = np.full(len(values), np.nan)
    for c in np.unique(counts):
        rows = counts == c
        if c < MIN_DIAGNOSTIC_DRAWS:
            continue   # arviz's ESS needs 4 draws of a chain (it warns and guesses below): NaN here
        data = xr.Dataset({"loss": (("chain", "draw", "row"), compact[rows, :c].T[None])})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            ess[rows] = az.ess(data, method="mean")["loss"].values
            mcse[rows] = az.mcse(data, method="mean")["loss"].values
    return ess, mcse


def variance_check(ds: xr.Dataset) -> xr.Dataset:
    """Residual vs crude variance of the total-loss estimator, per (doc, policy[, model]).

    Needs residual traces whose branches run to the horizon (W >= T - 1), since the
    loss itself must be identified.  Variables:

    * ``var_residual``: sample variance of the per-replicate residual loss
      (1 - S_T)(1 + R_{t*});
    * ``variance_reduction``: mean of (1 - S_T) S_T (1 + R_{t*})^2;
    * ``var_crude_implied`` = var_residual + variance_reduction: variance one crude
      replicate would have;
    * ``variance_ratio`` = var_residual / var_crude_implied (<= 1);
    * ``steps_residual`` = mean of T + K model steps per residual replicate,
      ``steps_crude`` = T;
    * ``efficiency`` = (var_crude_implied * T) / (var_residual * steps_residual):
      crude model steps needed per residual model step for equal precision (> 1
      favours the residual mode);
    * ``ess``, ``mcse``: arviz effective sample size and MCSE of the mean loss (NaN with
      fewer than 4 replicates, where arviz cannot estimate them)
      (replicates as one chain; ESS near n says they behave as independent draws).

    Parameters
    ----------
    ds : xarray.Dataset
        Residual traces with W >= T - 1 and at least 2 replicates.

    Returns
    -------
    xarray.Dataset
        The variables above over (doc, policy[, model]).

    Raises
    ------
    ValueError
        For other trace kinds, a short window, or fewer than 2 replicates.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(2, {"a": PolicyEffect(0.2)}, horizon=5, replicates=4, kind="residual")
    >>> bool((variance_check(ds)["variance_ratio"] <= 1).all())
    True
    """
    if ds.attrs.get("kind") != Kind.RESIDUAL:
        raise ValueError("variance_check needs residual traces (kind='residual')")
    if is_lazy(ds):
        return map_docs(variance_check, ds)
    rep = replicate_values(ds)
    if not rep.identified:
        raise ValueError(f"variance_check needs branches run to the horizon (W >= T - 1); "
                         f"this dataset has W = {rep.window}, T = {rep.horizon}")
    lay, T, n = rep.layout, rep.horizon, rep.layout.n_replicates
    if rep.counts.min() < 2:
        raise ValueError("variance_check needs at least 2 replicates per (doc, policy)")
    v = rep.values
    loss = v["occurrence"] + v["post_mismatch"]
    occ = v["occurrence"]
    stv = core_array(ds, "shared_tv", lay, ("replicate", "step"))
    s_T = np.empty_like(occ)
    for sl in row_chunks(lay.rows, n * T):
        s_T[sl] = survival_terms(stv[sl])[0][..., -1]
    # (1 + R) from the residual value itself: loss_i = (1 - S_T)(1 + R); R = 0 where no branch
    with np.errstate(invalid="ignore", divide="ignore"):
        one_plus_r = np.where(occ > 0, loss / np.where(occ > 0, occ, 1.0), 1.0)
    reduction = nanmean(occ * s_T * one_plus_r ** 2)
    _, se = mean_se(loss)
    counts = rep.counts
    var_res = se ** 2 * counts
    var_crude = var_res + reduction
    steps = nanmean(v["cost"])
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = var_res / var_crude
        eff = (var_crude * T) / (var_res * steps)
    ess, mcse = _mc_diagnostics(loss, rep.present)
    w = lambda a, d: lay.wrap(a, attrs={"description": d})  # noqa: E731
    return xr.Dataset({
        "var_residual": w(var_res, "variance of the per-replicate residual-branch loss"),
        "variance_reduction": w(reduction, "mean of (1 - S_T) S_T (1 + R)^2: estimated "
                                           "Var(crude) - Var(residual)"),
        "var_crude_implied": w(var_crude, "var_residual + variance_reduction: per-replicate crude variance"),
        "variance_ratio": w(ratio, "var_residual / var_crude_implied"),
        "steps_residual": w(steps, "mean model steps per residual replicate (T + K)"),
        "steps_crude": w(np.full(lay.rows, float(T)), "model steps per crude replicate (T)"),
        "efficiency": w(eff, "compute-adjusted efficiency: (var_crude * T) / (var_residual * (T + K))"),
        "ess": w(ess, "arviz effective sample size of the mean residual loss (replicates as one chain; "
                      f"NaN with fewer than {MIN_DIAGNOSTIC_DRAWS} replicates)"),
        "mcse": w(mcse, "arviz Monte Carlo SE of the residual loss estimate (NaN with fewer than "
                        f"{MIN_DIAGNOSTIC_DRAWS} replicates)"),
    }, attrs={"horizon": T, "n_replicates": n})
