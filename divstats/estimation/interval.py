"""The sharp interval for a finite observation window, estimated from traces (docs/statistics.md §6).

With branches observed W steps past divergence, the loss is only known to lie in

    [occurrence + window_mismatch, occurrence + window_mismatch + tail_capacity]

and no narrower interval is valid: :func:`divstats.truth.extremal.extremal_kernels`
builds, for any kernel pair, a pair over a tagged alphabet with the same observed
window law that attains either end. That construction works on kernels, not
traces, so it lives in ``truth/`` and this module (estimation) needs none of it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import xarray as xr

from divstats.traces.arrays import mean_se, nanmean, ratio_se, without_attrs
from divstats.traces.chunked import map_docs
from divstats.traces.replicates import replicate_values
from protocols.chunks import is_lazy

__all__ = ["interval_by_window", "sharp_interval"]


def sharp_interval(ds: xr.Dataset, window: int | None = None) -> xr.Dataset:
    """Sharp bounds on loss, mismatch fraction and rate from the observed window only.

    Coupled traces are first truncated to ``window`` (default: everything they
    observe, which makes lower = upper).  Output over (doc, policy[, model]):
    ``loss_lower``, ``loss_upper``, ``mismatch_fraction_lower``/``_upper`` (= /T),
    ``rate_lower``/``_upper`` (post-divergence part / exposure; NaN if exposure = 0),
    each with a Monte Carlo ``_se``.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace dataset of any kind.
    window : int, optional
        The observation window W (coupled and residual traces can be truncated).

    Returns
    -------
    xarray.Dataset
        The bounds and their SEs over (doc, policy[, model]).

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(2, {"a": PolicyEffect(0.2)}, horizon=5, replicates=4)
    >>> iv = sharp_interval(ds, window=1)
    >>> bool((iv["loss_lower"] <= iv["loss_upper"]).all())
    True
    """
    if is_lazy(ds):
        return map_docs(sharp_interval, ds, window=window)
    rep, values, attrs = _bounds(ds, window)
    return rep.layout.dataset(values, attrs, {"kind": rep.kind, "horizon": rep.horizon, "window": rep.window,
                                              "n_replicates": int(rep.counts.max(initial=0))})


def _bounds(ds: xr.Dataset, window: int | None) -> tuple[Any, dict[str, np.ndarray], dict[str, dict[str, str]]]:
    """The replicate values, each bound and SE per row (numpy) and each one's attrs."""
    rep = replicate_values(ds, window)
    v, T = rep.values, rep.horizon
    lo_i = v["occurrence"] + v["window_mismatch"]
    hi_i = lo_i + v["tail_capacity"]
    occ = nanmean(v["occurrence"])
    win = nanmean(v["window_mismatch"])
    tail = nanmean(v["tail_capacity"])
    lo = occ + win
    hi = lo + tail
    _, lo_se = mean_se(lo_i)
    _, hi_se = mean_se(hi_i)
    r_lo, r_lo_se = ratio_se(v["window_mismatch"], v["exposure"])
    r_hi, r_hi_se = ratio_se(v["window_mismatch"] + v["tail_capacity"], v["exposure"])
    doc = {
        "loss_lower": (lo, "occurrence + window_mismatch"),
        "loss_upper": (hi, "occurrence + window_mismatch + tail_capacity"),
        "mismatch_fraction_lower": (lo / T, "loss_lower / T"),
        "mismatch_fraction_upper": (hi / T, "loss_upper / T"),
        "rate_lower": (r_lo, "window_mismatch / exposure"),
        "rate_upper": (r_hi, "(window_mismatch + tail_capacity) / exposure"),
    }
    ses = {"loss_lower": lo_se, "loss_upper": hi_se, "mismatch_fraction_lower": lo_se / T,
           "mismatch_fraction_upper": hi_se / T, "rate_lower": r_lo_se, "rate_upper": r_hi_se}
    values, attrs = {}, {}
    for name, (val, what) in doc.items():
        values[name], attrs[name] = val, {"description": f"sharp bound (docs/statistics.md §6): {what}"}
        values[name + "_se"], attrs[name + "_se"] = ses[name], {"description": f"Monte Carlo SE of {name}"}
    return rep, values, attrs


def interval_by_window(ds: xr.Dataset, windows: Iterable[int]) -> xr.Dataset:
    """``sharp_interval`` for each W in ``windows``, stacked along a new ``window`` dim.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace dataset.
    windows : iterable of int
        Observation windows W.

    Returns
    -------
    xarray.Dataset
        :func:`sharp_interval`'s variables with a leading ``window`` dim.

    Raises
    ------
    ValueError
        For no window, or a window the traces cannot be truncated to.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(2, {"a": PolicyEffect(0.2)}, horizon=5, replicates=4)
    >>> interval_by_window(ds, [0, 2, 4])["window"].values.tolist()
    [0, 2, 4]
    """
    windows = [int(w) for w in windows]
    if not windows:
        raise ValueError("interval_by_window needs at least one window W")
    if is_lazy(ds):  # one pass over the data for all windows
        return map_docs(interval_by_window, ds, windows=windows)
    # Each window's bounds in numpy, stacked along ``window``, one Dataset built at the end
    # (without attrs, as before): a Dataset per window concatenated was 98% of the time.
    per_window = [_bounds(ds, w) for w in windows]
    lay = per_window[0][0].layout   # the replicate values' own, not a second layout(ds)
    data = {name: xr.Variable(("window", *lay.dims), np.stack([np.asarray(v[name]).reshape(lay.shape)
                                                               for _, v, _ in per_window]))
            for name in per_window[0][1]}
    coords = without_attrs(xr.Dataset(coords=lay.coords)).coords
    out = xr.Dataset(data, coords={**coords, "window": ("window", np.asarray(windows, dtype=np.int64))})
    out.attrs = {"kind": ds.attrs.get("kind"), "horizon": int(ds.attrs["horizon"])}
    return out
