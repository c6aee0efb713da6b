"""Per-replicate values of every estimand, one function per trace kind.

Each estimator in docs/statistics.md is a replicate mean of a per-replicate value (§4 crude,
§5 residual-branch, §7 reference weights).  This module computes those values,
vectorised over rows (flattened leading dims), replicates and steps, chunk by
chunk so that temporaries stay small at paper scale.  ``estimators`` turns them
into means, standard errors and derived quantities.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xarray as xr

from divstats.estimands import ESTIMANDS
from divstats.traces.arrays import Layout, core_array, kind_of, layout, present_replicates, row_chunks
from protocols import Kind, eos_ids

__all__ = [
    "REPLICATE_ESTIMANDS", "VALUES", "Replicates", "effective_window", "eos_of", "eos_rows", "first_divergence",
    "horizon_of", "reference_survival", "replicate_values", "survival_terms",
]

#: Estimands with a per-replicate value (``divstats.estimands.ESTIMANDS``' ``replicate`` slots, in slot order).
REPLICATE_ESTIMANDS: tuple[str, ...] = tuple(e.name for e in sorted((e for e in ESTIMANDS if e.replicate is not None),
                                                                    key=lambda e: e.replicate))
#: Per-replicate values produced for every kind: the estimands' and the cost.
VALUES = (*REPLICATE_ESTIMANDS, "cost")


@dataclass(frozen=True)
class Replicates:
    """Per-replicate values (rows, n) plus what is needed to interpret them."""

    kind: str
    layout: Layout
    horizon: int
    window: int           # effective W after truncation
    identified: bool      # post-divergence part identified (W >= T - 1)
    eos: int
    values: dict[str, np.ndarray]
    present: np.ndarray   # (rows, n): False for padded (absent) replicates, NaN in values

    @property
    def counts(self) -> np.ndarray:
        return self.present.sum(axis=-1)


def horizon_of(ds: xr.Dataset) -> int:
    """The horizon T of a trace dataset (its ``horizon`` attribute).

    Parameters
    ----------
    ds : xarray.Dataset
        A trace dataset.

    Returns
    -------
    int
        T.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(2, {"a": PolicyEffect(0.1)}, horizon=4, replicates=3)
    >>> horizon_of(ds)
    4
    """
    return int(ds.attrs["horizon"])


def eos_of(ds: xr.Dataset) -> int:
    """The dataset-wide EOS token id (the first of the EOS ids), -1 when there is none.

    A model may have several EOS ids (attr ``eos_token_ids``); :func:`eos_rows` holds
    them all and decides what counts as ended.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace dataset.

    Returns
    -------
    int
        The ``eos_token_id`` attribute, or -1.

    Examples
    --------
    >>> import xarray as xr
    >>> eos_of(xr.Dataset(attrs={"eos_token_id": 2})), eos_of(xr.Dataset())
    (2, -1)
    """
    eos = ds.attrs.get("eos_token_id", -1)
    return -1 if eos is None else int(eos)


def eos_rows(ds: xr.Dataset, lay: Layout) -> np.ndarray:
    """Every EOS id per row (flattened leading dims), padded with -1 (-1 alone: no EOS).

    The set is the ``eos_token_ids`` attr (a model with several EOS ids), else
    ``eos_token_id``. Datasets combined across models carry per-model coordinates
    (``eos_token_ids`` on (model, eos), else ``eos_token_id`` on model; the global
    attrs are then -1 / absent when the models differ); they take precedence.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace dataset.
    lay : Layout
        ``divstats.traces.arrays.layout(ds)``.

    Returns
    -------
    numpy.ndarray
        int64, shape ``(lay.rows, k)``: k EOS ids per row.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(2, {"a": PolicyEffect(0.1)}, horizon=4, replicates=3)
    >>> from divstats.traces.arrays import layout
    >>> eos_rows(ds, layout(ds)).shape
    (2, 1)
    >>> eos_rows(ds.assign_attrs(eos_token_ids=[2, 7, 9]), layout(ds)).tolist()
    [[2, 7, 9], [2, 7, 9]]
    """
    for name in ("eos_token_ids", "eos_token_id"):
        # membership, not ds.coords.get: a missing key costs xarray a 'did you mean' search
        coord = ds.variables[name] if name in ds.coords else None
        if coord is None:
            continue
        lead = [d for d in coord.dims if d in lay.dims]
        rest = [d for d in coord.dims if d not in lay.dims]
        if not lead or len(rest) > 1:
            continue
        var = coord.set_dims({**dict(zip(lay.dims, lay.shape, strict=True)), **{d: coord.sizes[d] for d in rest}})
        return var.transpose(*lay.dims, *rest).values.reshape(lay.rows, -1).astype(np.int64)
    ids = eos_ids(ds.attrs) or (-1,)
    return np.tile(np.asarray(ids, dtype=np.int64), (lay.rows, 1))


def effective_window(ds: xr.Dataset, window: int | None) -> int:
    """W actually used: the data's own window, or a truncation of it.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace dataset (coupled traces observe W = T, reference traces W = 0).
    window : int or None
        A truncation, or None for the data's own window.

    Returns
    -------
    int
        W, at most T.

    Raises
    ------
    ValueError
        For a negative window, or one beyond what the data observe.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(2, {"a": PolicyEffect(0.1)}, horizon=4, replicates=3)
    >>> effective_window(ds, None), effective_window(ds, 2)
    (4, 2)
    """
    kind, T = kind_of(ds), horizon_of(ds)
    data_w = {"coupled": T, "residual": int(ds.attrs.get("window", T)), "reference": 0}[kind]
    data_w = min(data_w, T)
    if window is None:
        return data_w
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    window = min(int(window), T)
    if window > data_w:
        raise ValueError(f"window {window} exceeds what this {kind} dataset observes (W = {data_w})")
    return window


def first_divergence(x: np.ndarray, y: np.ndarray, T: int) -> tuple[np.ndarray, np.ndarray]:
    """(D, tau) with tau = T + 1 standing for 'no divergence in 1..T'.

    Parameters
    ----------
    x, y : numpy.ndarray
        The two branches' tokens, steps on the last axis.
    T : int
        The horizon.

    Returns
    -------
    (numpy.ndarray, numpy.ndarray)
        D (``x != y`` per step) and tau (1-based step of the first mismatch, T + 1 if none).

    Examples
    --------
    >>> import numpy as np
    >>> d, tau = first_divergence(np.array([[1, 2, 3], [1, 2, 3]]), np.array([[1, 5, 3], [1, 2, 3]]), 3)
    >>> tau.tolist()
    [2, 4]
    """
    d = x != y
    hit = d.any(axis=-1)
    tau = np.where(hit, d.argmax(axis=-1) + 1, T + 1)
    return d, tau


def _both_ended(x: np.ndarray, y: np.ndarray, idx: np.ndarray, eos: np.ndarray) -> np.ndarray:
    """Both branches show the same EOS id at position idx (absorbing, so: both have ended
    by then and agree at every later step).

    ``eos`` holds each row's EOS ids, (rows, k) padded with -1, broadcast over replicates.
    Branches ended on *different* EOS ids keep emitting two tokens (a mismatch at TV 1
    every step), so they do not count as ended here.
    """
    if (eos < 0).all():
        return np.zeros(idx.shape, dtype=bool)
    e = eos.reshape(eos.shape[:1] + (1,) * (idx.ndim - 1) + eos.shape[1:])
    i = np.clip(idx, 0, x.shape[-1] - 1)[..., None]
    xe, ye = np.take_along_axis(x, i, -1)[..., 0], np.take_along_axis(y, i, -1)[..., 0]
    return ((xe[..., None] == e) & (e >= 0)).any(axis=-1) & (xe == ye)


def _coupled_chunk(x: np.ndarray, y: np.ndarray, T: int, W: int, eos: np.ndarray) -> dict[str, np.ndarray]:
    d, tau = first_divergence(x, y, T)
    occ = tau <= T
    steps = np.arange(1, T + 1)
    t = tau[..., None]
    in_window = (steps > t) & (steps <= t + W)
    K = np.where(occ, np.minimum(W, T - tau), 0)
    ended = _both_ended(x, y, tau + K - 1, eos)
    total = d.sum(axis=-1)
    return {
        "occurrence": occ.astype(np.float64),
        "exposure": np.maximum(T - tau, 0).astype(np.float64),
        "rmtd": np.minimum(tau, T).astype(np.float64),  # sum_{t=0}^{T-1} 1[tau > t]
        "post_mismatch": (total - occ).astype(np.float64),
        "window_mismatch": (d & in_window).sum(axis=-1).astype(np.float64),
        "tail_capacity": np.where(occ & ~ended, T - tau - K, 0).astype(np.float64),
        "cost": np.full(tau.shape, float(T)),
    }


def survival_terms(shared_tv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(S_t for t = 1..T, pi_t) from the survival path's TVs (NaN after the path stops).

    After a step with tv = 1 the path is dead: S is 0 from there on, so filling the
    NaNs with 0 leaves S and pi unchanged.

    Parameters
    ----------
    shared_tv : numpy.ndarray
        TV between the branches' next-token laws along the survival path, steps on the
        last axis (NaN after the path stops).

    Returns
    -------
    (numpy.ndarray, numpy.ndarray)
        S_t = prod_{s<=t} (1 - tv_s) and pi_t = S_{t-1} tv_t, same shape as the input.

    Examples
    --------
    >>> import numpy as np
    >>> s, pi = survival_terms(np.array([0.5, 0.5]))
    >>> s.tolist(), pi.tolist()
    ([0.5, 0.25], [0.5, 0.25])
    """
    d = _fill_tv(shared_tv)
    s = _accumulate_steps(np.multiply, np.subtract(1.0, d))
    s_prev = np.concatenate([np.ones(s.shape[:-1] + (1,)), s[..., :-1]], axis=-1)
    return s, s_prev * d


#: Below this many steps, and from _COLUMN_MIN_PATHS paths, a running product or sum over the
#: steps is taken one step (column) at a time across all paths instead of by numpy's accumulate.
_COLUMN_MAX_STEPS = 128
_COLUMN_MIN_PATHS = 1024


def _accumulate_steps(ufunc: np.ufunc, a: np.ndarray) -> np.ndarray:
    """``ufunc.accumulate(a, axis=-1)`` in place (``np.cumprod`` / ``np.cumsum``), the same numbers.

    numpy's accumulate walks one path (row) at a time with a serial dependency from step
    to step, which costs several times an elementwise pass when paths are short (T = 48:
    2.5 ms of an 11 ms ``estimate`` on 12288 paths).  Taking one step at a time across all
    paths does the same operations, ``a[t] = a[t-1] op a[t]`` in step order, so the result
    is bit-identical; it loses with few paths (Python overhead per step) and with long
    rows (a power-of-two stride between paths defeats the cache), where numpy's is kept.
    """
    T = a.shape[-1]
    if a.ndim < 2 or T >= _COLUMN_MAX_STEPS or a.size < _COLUMN_MIN_PATHS * T:
        return ufunc.accumulate(a, axis=-1, out=a)
    for t in range(1, T):
        ufunc(a[..., t - 1], a[..., t], out=a[..., t])
    return a


def _fill_tv(shared_tv: np.ndarray) -> np.ndarray:
    """float64 copy with the NaNs after a stopped path set to 0 (cheaper than nan_to_num)."""
    d = shared_tv.astype(np.float64)
    np.fmax(d, 0.0, out=d)  # fmax(NaN, 0) = 0; valid TVs are >= 0 and unchanged
    return d


def _survival_sums(shared_tv: np.ndarray, T: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per replicate: 1 - S_T, sum_t pi_t (T - t) and sum_{t=0}^{T-1} S_t, in few passes.

    pi_t (T - t) = S_{t-1} delta_t (T - t) is summed as a dot product of S_{t-1}
    with delta_t (T - t), without materialising pi (this is the hot loop at scale).
    """
    d = _fill_tv(shared_tv)
    s = _accumulate_steps(np.multiply, np.subtract(1.0, d))
    w = np.arange(T - 1, -1, -1, dtype=np.float64)          # T - t for t = 1..T
    exposure = d[..., 0] * w[0]
    if T > 1:
        exposure = exposure + np.einsum("...t,...t,t->...", s[..., :-1], d[..., 1:], w[1:])
    return 1.0 - s[..., -1], exposure, 1.0 + s[..., :-1].sum(axis=-1)


def _residual_chunk(stv: np.ndarray, tstar: np.ndarray, bx: np.ndarray, by: np.ndarray,
                    T: int, W: int, eos: np.ndarray) -> dict[str, np.ndarray]:
    occ, exposure, rmtd = _survival_sums(stv, T)
    branched = tstar > 0
    K = np.where(branched, np.minimum(W, T - tstar), 0)
    # Ages 1..W only: beyond K = min(W, T - t*) both branches hold -1 (schema mask),
    # so they never count as a mismatch and no per-age mask is needed.
    n_mis = np.count_nonzero(bx[..., 1:W + 1] != by[..., 1:W + 1], axis=-1)
    ended = _both_ended(bx, by, K, eos)
    w = np.where(branched, occ, 0.0)  # (1 - S_T), zero where no branch was drawn
    return {
        "occurrence": occ,
        "exposure": exposure,
        "rmtd": rmtd,
        "post_mismatch": w * n_mis,
        "window_mismatch": w * n_mis,
        "tail_capacity": np.where(branched & ~ended, w * (T - tstar - K), 0.0),
        "cost": T + K.astype(np.float64),
    }


def reference_survival(logp: np.ndarray, logq: np.ndarray) -> np.ndarray:
    """S_t = prod_{s<=t} min(1, q_s/p_s) along P's own sample (docs/statistics.md §7), t = 1..T.

    Parameters
    ----------
    logp, logq : numpy.ndarray
        Log-probabilities of P's sampled tokens under P and Q, steps on the last axis.

    Returns
    -------
    numpy.ndarray
        S_t, same shape.

    Examples
    --------
    >>> import numpy as np
    >>> reference_survival(np.log([0.5, 0.5]), np.log([0.25, 0.5])).tolist()
    [0.5, 0.5]
    """
    with np.errstate(invalid="ignore"):
        log_ratio = np.minimum(0.0, logq.astype(np.float64) - logp.astype(np.float64))
    return np.exp(_accumulate_steps(np.add, log_ratio))


def _reference_chunk(logp: np.ndarray, logq: np.ndarray, T: int) -> dict[str, np.ndarray]:
    s = reference_survival(logp, logq)
    s_prev = np.concatenate([np.ones(s.shape[:-1] + (1,)), s[..., :-1]], axis=-1)
    pi = s_prev - s
    steps = np.arange(1, T + 1)
    exposure = (pi * (T - steps)).sum(axis=-1)
    zero = np.zeros_like(exposure)
    return {
        "occurrence": 1.0 - s[..., -1],
        "exposure": exposure,
        "rmtd": 1.0 + s[..., :-1].sum(axis=-1),
        "post_mismatch": np.full_like(exposure, np.nan),
        "window_mismatch": zero,
        # W = 0: the whole post-divergence stretch is tail, and at age 0 the two
        # tokens differ, so they cannot both have ended.
        "tail_capacity": exposure,
        "cost": np.full_like(exposure, float(T)),
    }


def replicate_values(ds: xr.Dataset, window: int | None = None) -> Replicates:
    """Per-replicate values of every estimand for a trace dataset of any kind.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace dataset (coupled, residual or reference).
    window : int, optional
        Truncate the observation window (see :func:`effective_window`).

    Returns
    -------
    Replicates
        Values of :data:`VALUES` per (row, replicate), NaN for absent replicates.

    Raises
    ------
    ValueError
        For an unknown kind or an impossible window.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(2, {"a": PolicyEffect(0.1)}, horizon=4, replicates=3)
    >>> replicate_values(ds).values["occurrence"].shape
    (2, 3)
    """
    kind, T, eos = kind_of(ds), horizon_of(ds), eos_of(ds)
    W = effective_window(ds, window)
    lay = layout(ds)
    n = lay.n_replicates
    eos_r = eos_rows(ds, lay)
    out = {k: np.empty((lay.rows, n)) for k in VALUES}
    core = ("replicate", "step")
    if kind == Kind.COUPLED:
        arrays = [core_array(ds, "x_token", lay, core), core_array(ds, "y_token", lay, core), eos_r]
        fn = lambda x, y, e: _coupled_chunk(x, y, T, W, e)  # noqa: E731
    elif kind == Kind.RESIDUAL:
        arrays = [core_array(ds, "shared_tv", lay, core),
                  core_array(ds, "branch_step", lay, ("replicate",)),
                  core_array(ds, "branch_x_token", lay, ("replicate", "age")),
                  core_array(ds, "branch_y_token", lay, ("replicate", "age")), eos_r]
        fn = lambda a, b, c, d, e: _residual_chunk(a, b, c, d, T, W, e)  # noqa: E731
    else:
        arrays = [core_array(ds, v, lay, core) for v in ("x_logp", "x_logq")]
        fn = lambda a, b: _reference_chunk(a, b, T)  # noqa: E731
    for sl in row_chunks(lay.rows, n * T):
        part = fn(*(a[sl] for a in arrays))
        for k in VALUES:
            out[k][sl] = part[k]
    identified = kind != Kind.REFERENCE and W >= T - 1
    if not identified:
        out["post_mismatch"][:] = np.nan
    present = present_replicates(ds, lay)
    if not present.all():
        for k in VALUES:
            out[k][~present] = np.nan
    return Replicates(kind, lay, T, W, identified, eos, out, present)
