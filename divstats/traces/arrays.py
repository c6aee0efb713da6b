"""Array plumbing shared by the estimators: leading dims, chunking, replicate moments.

Every estimator reduces the ``replicate`` axis (and ``step``/``age``) and keeps
all other dims (``doc``, ``policy``, an optional ``model``, anything else).  The
data are moved to numpy as ``(rows, replicate, step)`` with the leading dims
flattened into ``rows``; results come back as DataArrays over the leading dims.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xarray as xr

from protocols import Kind

__all__ = [
    "CHUNK_ELEMENTS", "CORE_DIMS", "KEY_VARIABLE", "Layout", "core_array", "cov_of_means", "kind_of", "layout",
    "mean_se", "nanmean", "present_replicates", "ratio_se", "row_chunks", "without_attrs",
]

CORE_DIMS = ("replicate", "step", "age")
#: Rows per chunk are chosen so that one float64 temporary stays near this size
#: (512 KiB: the passes over a chunk stay in a core's L2 cache, and the allocator
#: reuses such blocks from its heap).  At 8 MiB (1 << 20, before issue 20) every
#: chunk's temporaries were mapped afresh and page-faulted on each call: 850-1500
#: minor faults per ``estimate`` on 48 docs x 4 policies x 64 replicates x T = 48,
#: about half its time; 4500 per call at 36 docs x T = 512.
CHUNK_ELEMENTS = 1 << 16

KEY_VARIABLE = {"coupled": "tv", "residual": "shared_tv", "reference": "x_token"}


@dataclass(frozen=True)
class Layout:
    """Where the leading (non-core) dims of a trace dataset are and how big they are."""

    dims: tuple[str, ...]
    shape: tuple[int, ...]
    coords: dict[str, Any]
    n_replicates: int

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def wrap(self, values: np.ndarray, extra_dims: Sequence[str] = (),
             extra_coords: Mapping[str, Any] | None = None, attrs: Mapping[str, Any] | None = None,
             ) -> xr.DataArray:
        """(rows, *extra) numpy -> DataArray over (*lead dims, *extra dims)."""
        arr = np.asarray(values).reshape(self.shape + np.asarray(values).shape[1:])
        coords = dict(self.coords)
        coords.update(extra_coords or {})
        return xr.DataArray(arr, dims=self.dims + tuple(extra_dims), coords=coords, attrs=dict(attrs or {}))

    def dataset(self, arrays: Mapping[str, np.ndarray], attrs: Mapping[str, Mapping[str, Any]],
                global_attrs: Mapping[str, Any]) -> xr.Dataset:
        """Many (rows,) arrays -> one Dataset over the lead dims (coords attached once)."""
        data = {k: xr.Variable(self.dims, np.asarray(v).reshape(self.shape), attrs=dict(attrs[k]))
                for k, v in arrays.items()}
        return xr.Dataset(data, coords=self.coords, attrs=dict(global_attrs))


def kind_of(ds: xr.Dataset) -> str:
    """The trace kind (``coupled``, ``residual`` or ``reference``) from the dataset's attrs.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace dataset.

    Returns
    -------
    str
        The ``kind`` attribute.

    Raises
    ------
    ValueError
        When ``kind`` is missing or not a known kind.

    Examples
    --------
    >>> import xarray as xr
    >>> kind_of(xr.Dataset(attrs={"kind": "residual"}))
    'residual'
    """
    kind = ds.attrs.get("kind")
    if kind not in KEY_VARIABLE:
        raise ValueError(f"dataset kind {kind!r} is not one of {tuple(KEY_VARIABLE)}")
    return kind


def layout(ds: xr.Dataset) -> Layout:
    """Where the leading (non-core) dims of a trace dataset are and how big they are.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace dataset.

    Returns
    -------
    Layout
        The leading dims (those of the kind's key variable other than replicate,
        step and age), their shape, the coords over them and the replicate count.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> lay = layout(simulate_study(2, {"a": PolicyEffect(0.1)}, horizon=4, replicates=3))
    >>> lay.dims, lay.rows, lay.n_replicates
    (('doc', 'policy'), 2, 3)
    """
    # Variables, not ds[name] / ds.coords.items(): each DataArray xarray builds gathers its own
    # coords, which cost more than this whole function's work on a small dataset
    variables = ds.variables
    key = variables[KEY_VARIABLE[kind_of(ds)]]
    dims = tuple(d for d in key.dims if d not in CORE_DIMS)
    shape = tuple(int(ds.sizes[d]) for d in dims)
    coords = {name: variables[name] for name in ds.coords
              if variables[name].dims and set(variables[name].dims) <= set(dims)}
    return Layout(dims, shape, coords, int(ds.sizes["replicate"]))


def core_array(ds: xr.Dataset, name: str, lay: Layout, core: Sequence[str]) -> np.ndarray:
    """Variable ``name`` as a numpy array (rows, *core); a view when already in order.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace dataset.
    name : str
        A variable of ``ds``.
    lay : Layout
        ``layout(ds)``.
    core : sequence of str
        The trailing dims, in order (e.g. ``("replicate", "step")``).

    Returns
    -------
    numpy.ndarray
        Shape ``(lay.rows, *core sizes)``.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(2, {"a": PolicyEffect(0.1)}, horizon=4, replicates=3)
    >>> core_array(ds, "x_token", layout(ds), ("replicate", "step")).shape
    (2, 3, 4)
    """
    values = ds.variables[name].transpose(*lay.dims, *core).values
    return values.reshape((lay.rows,) + values.shape[len(lay.dims):])


def row_chunks(rows: int, per_row: int) -> Iterator[slice]:
    """Slices over ``rows`` sized so one float64 temporary stays near CHUNK_ELEMENTS values.

    Parameters
    ----------
    rows : int
        Number of rows.
    per_row : int
        Values one row contributes to the temporary.

    Returns
    -------
    iterator of slice
        Consecutive slices covering ``range(rows)``.

    Examples
    --------
    >>> list(row_chunks(3, CHUNK_ELEMENTS))
    [slice(0, 1, None), slice(1, 2, None), slice(2, 3, None)]
    """
    step = max(1, CHUNK_ELEMENTS // max(1, per_row))
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


def nanmean(x: np.ndarray) -> np.ndarray:
    """Mean over the last axis ignoring NaN (padded replicates); NaN when nothing is left.

    Parameters
    ----------
    x : numpy.ndarray
        Replicates on the last axis.

    Returns
    -------
    numpy.ndarray
        ``x`` reduced over the last axis.

    Examples
    --------
    >>> import numpy as np
    >>> nanmean(np.array([[1.0, np.nan, 3.0], [np.nan, np.nan, np.nan]])).tolist()
    [2.0, nan]
    """
    ok = ~np.isnan(x)
    if ok.all():
        return x.mean(axis=-1)
    n = ok.sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, np.where(ok, x, 0.0).sum(axis=-1) / n, np.nan)


def _centred(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x - mean with NaNs as 0, count of non-NaN) over the last axis."""
    _, dev, n = _moments(x)
    return dev, n


def _moments(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | int]:
    """(nanmean(x), x - that mean with NaNs as 0, count of non-NaN) over the last axis.

    One NaN scan instead of one per step (nanmean, the count, the mask): the same
    expressions as nanmean and the masked deviations, so the same numbers; without any
    NaN (no padded replicates) the mask is left out and the count is the axis length.
    """
    ok = ~np.isnan(x)
    if ok.all():
        m = x.mean(axis=-1)
        return m, x - m[..., None], x.shape[-1]
    n = ok.sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        m = np.where(n > 0, np.where(ok, x, 0.0).sum(axis=-1) / n, np.nan)
    return m, np.where(ok, x - m[..., None], 0.0), n


def mean_se(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Replicate mean and its Monte Carlo SE (sample SD / sqrt(n)) over the last axis.

    NaN entries are replicates that are absent (padding when datasets with different
    replicate counts were combined): n counts the others.  SE is NaN when n < 2.

    Parameters
    ----------
    x : numpy.ndarray
        Replicates on the last axis (NaN: absent).

    Returns
    -------
    (numpy.ndarray, numpy.ndarray)
        The mean and its standard error, the last axis reduced.

    Examples
    --------
    >>> import numpy as np
    >>> m, se = mean_se(np.array([1.0, 2.0, 3.0]))
    >>> float(m), round(float(se), 4)
    (2.0, 0.5774)
    """
    m, dev, n = _moments(x)
    with np.errstate(invalid="ignore", divide="ignore"):
        se = np.sqrt((dev ** 2).sum(axis=-1) / ((n - 1) * n))
    return m, np.where(n >= 2, se, np.nan)


def ratio_se(num: np.ndarray, den: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ratio of replicate means and its delta-method SE.

    r = mean(num) / mean(den); SE = SD(num - r den) / (sqrt(n) mean(den)), which is
    the delta method with the sample covariance of (num, den).  NaN where
    mean(den) = 0 (the ratio is not defined there).  NaNs are absent replicates.

    Parameters
    ----------
    num, den : numpy.ndarray
        Replicates of numerator and denominator on the last axis (NaN: absent).

    Returns
    -------
    (numpy.ndarray, numpy.ndarray)
        The ratio and its SE, the last axis reduced.

    Examples
    --------
    >>> import numpy as np
    >>> r, se = ratio_se(np.array([1.0, 2.0]), np.array([2.0, 2.0]))
    >>> float(r)
    0.75
    """
    absent = np.isnan(num) | np.isnan(den)
    if absent.any():
        num, den = np.where(absent, np.nan, num), np.where(absent, np.nan, den)
    mn, md = nanmean(num), nanmean(den)
    ok = md > 0
    safe = np.where(ok, md, 1.0)
    r = np.where(ok, mn / safe, np.nan)
    _, se = mean_se(num - np.where(ok, r, 0.0)[..., None] * den)
    return r, np.where(ok, se / safe, np.nan)


def cov_of_means(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Monte Carlo covariance of two replicate means (sample covariance / n).

    Parameters
    ----------
    a, b : numpy.ndarray
        Paired replicates on the last axis (NaN: absent).

    Returns
    -------
    numpy.ndarray
        The covariance, NaN with fewer than two replicates.

    Examples
    --------
    >>> import numpy as np
    >>> float(cov_of_means(np.array([1.0, 2.0, 3.0]), np.array([2.0, 4.0, 6.0])))
    0.6666666666666666
    """
    da, n = _centred(a)
    db, _ = _centred(b)
    with np.errstate(invalid="ignore", divide="ignore"):
        cov = (da * db).sum(axis=-1) / ((n - 1) * n)
    return np.where(n >= 2, cov, np.nan)


def present_replicates(ds: xr.Dataset, lay: Layout) -> np.ndarray:
    """(rows, n) mask of replicates that exist and count (False for padding, and for a pilot).

    A real replicate always has its first step: a token for coupled/reference traces
    and a TV on the survival path for residual traces. In an adaptive collection
    (a ``round`` coordinate on ``replicate``, written by ``kvdiv pack``) round 0 is
    the pilot that chose how many replicates the later rounds got; pooled with them
    it biases every estimate (docs/design.md, "Spending further replicates where
    they pay"), so its replicates do not count here: every estimate is the later
    rounds' alone, which is unbiased. Drop the coordinate
    (``ds.drop_vars("round")``) to count them.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace dataset.
    lay : Layout
        ``layout(ds)``.

    Returns
    -------
    numpy.ndarray
        Boolean, shape ``(lay.rows, lay.n_replicates)``.

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(2, {"a": PolicyEffect(0.1)}, horizon=4, replicates=3)
    >>> bool(present_replicates(ds, layout(ds)).all())
    True
    """
    kind = kind_of(ds)
    if kind == Kind.RESIDUAL:
        first = ds.variables["shared_tv"].isel(step=0).transpose(*lay.dims, "replicate").values
        present = ~np.isnan(first).reshape(lay.rows, -1)
    else:
        first = ds.variables["x_token"].isel(step=0).transpose(*lay.dims, "replicate").values
        present = (first >= 0).reshape(lay.rows, -1)
    # membership, not ds.coords.get: a missing key costs xarray a 'did you mean' search
    rounds = ds.variables["round"] if "round" in ds.coords else None
    if rounds is not None and rounds.dims == ("replicate",):
        present &= np.asarray(rounds.values) >= 1
    return present


def without_attrs(obj: xr.Dataset | xr.DataArray) -> xr.Dataset | xr.DataArray:
    """``obj.drop_attrs()``: the same object with no attrs on it, its variables or its coordinates.

    xarray's ``drop_attrs`` assigns each variable back through a merge, which costs
    ~5 ms a variable: most of ``interval_by_window``'s time and a large part of
    building results.nc. One shallow copy whose variables' attrs are then emptied
    is the same object (tests/test_divstats_report.py compares the two).

    Parameters
    ----------
    obj : xarray.Dataset or xarray.DataArray
        Anything; it is not modified (the data are shared, as ``drop_attrs`` shares them).

    Returns
    -------
    xarray.Dataset or xarray.DataArray
        A shallow copy without attrs.

    Examples
    --------
    >>> ds = xr.Dataset({"x": ("a", [1.0], {"units": "m"})}, coords={"a": ("a", [0], {"long": "A"})},
    ...                 attrs={"title": "t"})
    >>> without_attrs(ds).identical(ds.drop_attrs()), ds.attrs["title"]
    (True, 't')
    """
    out = obj.copy(deep=False)
    out.attrs = {}
    owned = [out.variable, *out.coords.variables.values()] if isinstance(out, xr.DataArray) else out.variables.values()
    for var in owned:
        var.attrs = {}
    # drop_attrs re-assigns the index coordinates last, which moves them after the others; so
    # does this (one merge), so that results.nc lists its variables in the same order as before
    index_vars = {k: v for _, idx_vars in out.xindexes.group_by_index() for k, v in idx_vars.items()}
    return out.assign_coords(index_vars) if isinstance(out, xr.DataArray) else out.assign(index_vars)
