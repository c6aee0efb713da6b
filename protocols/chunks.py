"""Dask-backed trace datasets: which ones are lazy, their document chunks, and a cluster when asked.

A trace dataset opened with ``open_traces(path, chunks=...)`` holds dask arrays
chunked along ``doc`` only: a document chunk is the unit that validation
(``protocols.validate``) and every divstats estimator process independently, in
bounded memory.  Computations run on the active dask scheduler: the local threads
by default, or a ``dask.distributed`` cluster inside :func:`dask_client`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import xarray as xr

__all__ = ["dask_client", "doc_slices", "is_lazy"]


def is_lazy(ds: xr.Dataset | xr.DataArray) -> bool:
    """True when any data variable of ``ds`` is a dask array (not yet in memory).

    Examples
    --------
    >>> import xarray as xr
    >>> is_lazy(xr.Dataset({"a": ("doc", [1, 2])}))
    False
    """
    variables = ds.data_vars.values() if isinstance(ds, xr.Dataset) else [ds]
    return any(v.chunks is not None for v in variables)


def doc_slices(ds: xr.Dataset) -> list[slice]:
    """The document ranges of ``ds``'s dask chunks along ``doc`` (one range if ``ds`` is in memory).

    Raises
    ------
    ValueError
        When ``ds`` is chunked along another dim too: a chunk must hold whole documents.

    Examples
    --------
    >>> import xarray as xr
    >>> doc_slices(xr.Dataset({"a": ("doc", [1, 2, 3])}).chunk(doc=2))
    [slice(0, 2, None), slice(2, 3, None)]
    """
    n = int(ds.sizes["doc"])
    if not is_lazy(ds):
        return [slice(0, n)]
    chunks = ds.chunksizes
    for dim, sizes in chunks.items():
        if dim != "doc" and len(sizes) > 1:
            raise ValueError(f"dataset is chunked along {dim!r} ({len(sizes)} chunks); chunk along 'doc' only "
                             "(protocols.open_traces(path, chunks=N)) so that a chunk holds whole documents")
    out, start = [], 0
    for size in chunks.get("doc", (n,)):
        out.append(slice(start, start + int(size)))
        start += int(size)
    return out


@contextlib.contextmanager
def dask_client(workers: int | None = None, scheduler: str | None = None, *,
                memory_limit: str | None = "auto") -> Iterator[Any]:
    """A ``dask.distributed`` client for the duration of a ``with`` block (None when neither is given).

    Parameters
    ----------
    workers : int, optional
        Start a local cluster of this many single-threaded worker processes.
    scheduler : str, optional
        Connect to an existing scheduler at this address instead (``tcp://host:8786``).
    memory_limit : str, optional
        Per-worker memory limit of a local cluster (dask's syntax, e.g. ``"1.5GB"``).

    Yields
    ------
    distributed.Client or None
        While the block runs, dask computations use it.

    Raises
    ------
    ValueError
        When both ``workers`` and ``scheduler`` are given, or ``workers < 1``.
    ImportError
        When ``distributed`` is not installed (``pip install 'kvdiv[cluster]'``).

    Examples
    --------
    >>> with dask_client(workers=2):       # doctest: +SKIP
    ...     est = divstats.estimate(protocols.open_traces("traces.zarr", chunks="auto"))
    """
    if workers is not None and scheduler is not None:
        raise ValueError("give either workers (a local cluster) or scheduler (an existing one), not both")
    if workers is None and scheduler is None:
        yield None
        return
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    try:
        from distributed import Client, LocalCluster
    except ImportError as exc:  # depends on the installed extras
        raise ImportError("a dask cluster needs the 'distributed' package: pip install 'kvdiv[cluster]'") from exc
    if scheduler is not None:
        with Client(scheduler) as client:
            yield client
        return
    with (LocalCluster(n_workers=int(workers), threads_per_worker=1, processes=True, memory_limit=memory_limit,
                       dashboard_address=None) as local, Client(local) as client):
        yield client
