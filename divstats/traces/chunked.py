"""The estimators on dask-backed trace datasets, one document chunk at a time.

Every per-(document, policy) estimator in divstats reduces the ``replicate`` and
``step``/``age`` axes and keeps ``doc``: a chunk of documents is an independent
problem.  :func:`map_docs` therefore runs the ordinary in-memory function on each
document chunk of a lazily opened dataset (``protocols.open_traces(path,
chunks=...)``) as one dask task, and concatenates the small per-document results
along ``doc``.  Only one chunk per worker thread is in memory at a time, whatever
the size of the file; the tasks run on whatever dask scheduler is active (the
local threads by default, a ``dask.distributed`` cluster when a ``Client`` is
open, see ``protocols.cluster.dask_client``).

The results are the in-memory function's own numbers (each row is computed by the
same code on the same values), so they equal an in-memory run to rounding.  What
follows the per-document step (``aggregate``, the bootstrap over documents, the
plan's paired tests) works on those small per-document estimates in memory.

The public entry points (``divstats.estimate``, ``survival``, ``branch_tv``, ...)
dispatch here themselves when handed a dask-backed dataset::

    if is_lazy(ds):
        return map_docs(estimate, ds, window=window)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from protocols.chunks import DocChunk, doc_chunks, is_lazy

__all__ = ["MERGED_ATTRS", "UNREAD", "concat_docs", "load", "map_docs", "map_docs_many"]

#: Result attributes that describe the whole dataset, merged over chunks (others are equal in every chunk).
MERGED_ATTRS: dict[str, Callable[[list[Any]], Any]] = {"n_replicates": max, "n_replicates_min": min}

#: Trace variables, by kind, that no divstats estimator reads (validation does): left on disk by default.
UNREAD: dict[str, tuple[str, ...]] = {"coupled": ("x_logp", "y_logp"), "residual": ("shared_token",)}


def load(ds: xr.Dataset) -> xr.Dataset:
    """``ds`` in memory: computed if dask-backed, else unchanged (for small per-document results).

    Parameters
    ----------
    ds : xarray.Dataset
        Any dataset, e.g. per-document estimates.

    Returns
    -------
    xarray.Dataset
        With numpy-backed variables.

    Examples
    --------
    >>> import xarray as xr
    >>> lazy = xr.Dataset({"a": ("doc", [1.0, 2.0])}).chunk(doc=1)
    >>> type(load(lazy)["a"].data).__name__
    'ndarray'
    """
    return ds.compute() if is_lazy(ds) else ds


def _apply(fns: Mapping[str, tuple[Callable[..., xr.Dataset], dict[str, Any]]], chunk: DocChunk,
           ) -> dict[str, xr.Dataset]:
    """Read one document chunk and run each function on it (the task body)."""
    part = chunk.load()
    return {name: fn(part, **kwargs) for name, (fn, kwargs) in fns.items()}


def _merge_attrs(parts: list[xr.Dataset]) -> dict[str, Any]:
    attrs = dict(parts[0].attrs)
    for key, merge in MERGED_ATTRS.items():
        if key in attrs:
            attrs[key] = merge([p.attrs[key] for p in parts])
    return attrs


def _joined(name: str, parts: list[xr.Dataset]) -> xr.Variable:
    """Variable ``name`` of the first part, with its ``doc`` axis joined over all parts."""
    var = parts[0].variables[name]
    if "doc" not in var.dims:
        return var
    axis = var.dims.index("doc")
    data = np.concatenate([p.variables[name].values for p in parts], axis=axis)
    return xr.Variable(var.dims, data, attrs=var.attrs, encoding=var.encoding)


def _check_aligned(parts: list[xr.Dataset]) -> None:
    """Every part has the first part's variables and its indexes other than ``doc`` (e.g. ``age``)."""
    first = parts[0]
    for i, part in enumerate(parts[1:], start=1):
        if list(part.variables) != list(first.variables):
            raise ValueError(f"per-chunk results differ in their variables: chunk 0 has {list(first.variables)}, "
                             f"chunk {i} has {list(part.variables)}")
        for dim, index in first.xindexes.items():
            if dim != "doc" and not index.equals(part.xindexes[dim]):
                raise ValueError(f"per-chunk results differ along {dim!r} (chunk 0 vs chunk {i}); "
                                 "a per-document function must give every chunk the same coordinates")


def concat_docs(parts: list[xr.Dataset]) -> xr.Dataset:
    """Per-chunk results -> one result along ``doc`` (variables without ``doc`` from the first chunk).

    The values are joined with ``numpy.concatenate`` variable by variable, which is
    what ``xarray.concat(parts, "doc", data_vars="minimal", coords="minimal",
    compat="override", join="exact")`` gives, without its per-part bookkeeping (it
    dominated the calling process's time at a hundred chunks).

    Parameters
    ----------
    parts : list of xarray.Dataset
        Results of one function on consecutive document chunks, in order, in memory.

    Returns
    -------
    xarray.Dataset
        Concatenated along ``doc``; attributes from the first part, except those in
        :data:`MERGED_ATTRS` (e.g. ``n_replicates``, the largest over the parts).

    Raises
    ------
    ValueError
        When the parts differ in their variables or in a coordinate other than ``doc``.

    Examples
    --------
    >>> import xarray as xr
    >>> a = xr.Dataset({"x": ("doc", [1.0])}, attrs={"n_replicates": 4})
    >>> b = xr.Dataset({"x": ("doc", [2.0])}, attrs={"n_replicates": 6})
    >>> out = concat_docs([a, b])
    >>> out["x"].values.tolist(), out.attrs["n_replicates"]
    ([1.0, 2.0], 6)
    """
    if len(parts) == 1:
        return parts[0]
    _check_aligned(parts)
    first = parts[0]
    return xr.Dataset({name: _joined(name, parts) for name in first.data_vars},
                      coords={name: _joined(name, parts) for name in first.coords}, attrs=_merge_attrs(parts))


def map_docs_many(fns: Mapping[str, tuple[Callable[..., xr.Dataset], Mapping[str, Any]]], ds: xr.Dataset,
                  *, skip: Sequence[str] | None = None) -> dict[str, xr.Dataset]:
    """Several per-document functions in one pass over the data (each chunk is read once).

    Parameters
    ----------
    fns : mapping
        ``name -> (function, keyword arguments)``; each function takes an in-memory
        trace dataset and returns a Dataset with a ``doc`` dim (``divstats.estimate``,
        ``divstats.sharp_interval``, ...).
    ds : xarray.Dataset
        Trace dataset, usually dask-backed and chunked along ``doc`` only.
    skip : sequence of str, optional
        Variables not to read (default :data:`UNREAD` for the dataset's kind; pass
        ``()`` for a function that needs every variable).

    Returns
    -------
    dict
        ``name -> result`` over all documents, in memory.

    Raises
    ------
    ValueError
        When ``ds`` is chunked along a dim other than ``doc`` (a replicate or step
        chunk is not an independent problem).

    Examples
    --------
    >>> import divstats as D
    >>> out = map_docs_many({"est": (D.estimate, {}), "si": (D.sharp_interval, {})}, ds)  # doctest: +SKIP
    """
    import dask  # lazy: dask only for lazily loaded (chunked) traces

    fns = {name: (fn, dict(kwargs)) for name, (fn, kwargs) in fns.items()}
    skip = UNREAD.get(ds.attrs.get("kind"), ()) if skip is None else skip
    ds = ds.drop_vars([name for name in skip if name in ds.data_vars])
    tasks = [dask.delayed(_apply)(fns, chunk) for chunk in doc_chunks(ds)]
    results = dask.compute(*tasks)
    return {name: concat_docs([r[name] for r in results]) for name in fns}


def map_docs(fn: Callable[..., xr.Dataset], ds: xr.Dataset, **kwargs: Any) -> xr.Dataset:
    """``fn(ds, **kwargs)`` computed one document chunk at a time; see :func:`map_docs_many`.

    Parameters
    ----------
    fn : callable
        A per-document function of an in-memory trace dataset returning a Dataset
        with a ``doc`` dim.
    ds : xarray.Dataset
        Trace dataset, dask-backed and chunked along ``doc`` only.
    **kwargs
        Passed to ``fn``.

    Returns
    -------
    xarray.Dataset
        ``fn``'s result over all documents, in memory.

    Raises
    ------
    ValueError
        When ``ds`` is chunked along a dim other than ``doc``.

    Examples
    --------
    >>> import divstats as D, protocols
    >>> ds = protocols.open_traces("traces.zarr", chunks=16)  # doctest: +SKIP
    >>> est = map_docs(D.estimate, ds, window=8)              # doctest: +SKIP
    """
    return map_docs_many({"out": (fn, kwargs)}, ds)["out"]


