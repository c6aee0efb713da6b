"""Dask-backed trace datasets: which ones are lazy, their document chunks, and a cluster when asked.

A trace dataset opened with ``open_traces(path, chunks=...)`` holds dask arrays
chunked along ``doc`` only: a document chunk is the unit that validation
(``protocols.validate``) and every divstats estimator process independently, in
bounded memory.  Computations run on the active dask scheduler: the local threads
by default, or a ``dask.distributed`` cluster inside :func:`dask_client`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import xarray as xr

__all__ = ["LAZY_ABOVE_BYTES", "WORKER_CONFIG", "WORKER_MALLOC", "DocChunk", "cluster_options", "dask_client",
           "doc_chunks", "doc_slices", "is_lazy", "read_chunks"]

#: glibc malloc settings for local workers. distributed's default (a 64 KiB trim threshold) hands freed
#: memory back to the OS at once, so every chunk's reads and temporaries (megabytes each) page-fault
#: anew: chunk tasks ran about 3x slower here. A 64 MiB threshold keeps one chunk's worth; two arenas
#: keep the reader threads' and the task's freed memory from multiplying per thread. Setting any of
#: these turns off glibc's sliding mmap threshold, which would leave every array over 128 KiB to its
#: own mmap (zeroed and page-faulted on each use, freed at once): the mmap threshold is set with them,
#: so that a chunk's temporaries (about 25 MiB each at 64 MiB of traces per chunk) are reused from the
#: heap; without it branch_tv took twice the CPU time in a worker that it takes in the calling process.
WORKER_MALLOC = {"MALLOC_TRIM_THRESHOLD_": 64 * 2**20, "MALLOC_MMAP_THRESHOLD_": 64 * 2**20, "MALLOC_ARENA_MAX": 2}

#: dask settings for local workers: no statistical profiler (it samples each worker's stack every 10 ms
#: for a dashboard these clusters do not have; about a tenth of a worker's CPU time on the chunk tasks).
WORKER_CONFIG = {"distributed.worker.profile.enabled": False}

#: Commands read a trace file lazily (chunk by chunk) by default when its data exceed this size in memory.
LAZY_ABOVE_BYTES = 2 * 2**30


def is_lazy(ds: xr.Dataset | xr.DataArray) -> bool:
    """True when any data variable of ``ds`` is a dask array (not yet in memory).

    Parameters
    ----------
    ds : xarray.Dataset or xarray.DataArray

    Returns
    -------
    bool

    Raises
    ------
    AttributeError
        For an object that is neither a Dataset nor a DataArray.

    Examples
    --------
    >>> import xarray as xr
    >>> is_lazy(xr.Dataset({"a": ("doc", [1, 2])}))
    False
    """
    if not isinstance(ds, xr.Dataset):
        return ds.chunks is not None
    # the Variables themselves: ``ds.data_vars.values()`` builds a DataArray per variable, and
    # every estimator asks this of its input (it was 20% of validating a small dataset)
    variables = ds.variables
    return any(variables[name].chunks is not None for name in ds.data_vars)


def doc_slices(ds: xr.Dataset) -> list[slice]:
    """The document ranges of ``ds``'s dask chunks along ``doc`` (one range if ``ds`` is in memory).

    Parameters
    ----------
    ds : xarray.Dataset
        A trace dataset.

    Returns
    -------
    list of slice
        Consecutive, covering every document.

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
    try:
        chunks = ds.chunksizes
    except ValueError as exc:  # variables chunked differently along one dim
        raise ValueError(f"{exc} Chunk every variable alike along 'doc' only, e.g. ds.chunk(doc=16).") from exc
    for dim, sizes in chunks.items():
        if dim != "doc" and len(sizes) > 1:
            raise ValueError(f"dataset is chunked along {dim!r} ({len(sizes)} chunks); chunk along 'doc' only "
                             "(protocols.open_traces(path, chunks=N)) so that a chunk holds whole documents")
    out, start = [], 0
    for size in chunks.get("doc", (n,)):
        out.append(slice(start, start + int(size)))
        start += int(size)
    return out


class DocChunk:
    """One document chunk of a dask-backed dataset, still unread.

    Handed to a dask task as an argument, it stays opaque to dask (a plain object:
    not a dask collection, nor a dataclass or container, which dask would look
    into and compute first), so the task reads its chunk itself with :meth:`load`
    on the worker that runs it: no chunk is read on one worker and shipped to
    another, and a task holds one chunk at a time.

    Parameters
    ----------
    ds : xarray.Dataset
        The chunk, dask-backed.
    start : int
        Index of the chunk's first document in the whole dataset.
    """

    __slots__ = ("ds", "start")

    def __init__(self, ds: xr.Dataset, start: int) -> None:
        self.ds, self.start = ds, int(start)

    def __repr__(self) -> str:
        return f"DocChunk(docs {self.start}..{self.start + self.ds.sizes.get('doc', 0) - 1})"

    def load(self) -> xr.Dataset:
        """The chunk in memory, read in this thread (the synchronous scheduler, inside the calling task).

        A new dataset: the chunk itself stays unread, since a worker keeps a task's
        arguments until its result is collected (``Dataset.load`` would fill them in).
        """
        return self.ds.compute(scheduler="sync")


def doc_chunks(ds: xr.Dataset, names: list[str] | None = None) -> list[DocChunk]:
    """``ds`` (or its variables ``names``) cut into its document chunks, unread; see :func:`doc_slices`.

    Parameters
    ----------
    ds : xarray.Dataset
        A dask-backed trace dataset chunked along ``doc``.
    names : list of str, optional
        Only these variables (default: all).

    Returns
    -------
    list of DocChunk

    Raises
    ------
    ValueError
        When ``ds`` is chunked along another dim too (see :func:`doc_slices`).

    Examples
    --------
    >>> import xarray as xr
    >>> [c.start for c in doc_chunks(xr.Dataset({"a": ("doc", [1, 2, 3])}).chunk(doc=2))]
    [0, 2]
    """
    sub = ds if names is None else ds[names]
    return [DocChunk(sub.isel(doc=sl), sl.start) for sl in doc_slices(ds)]


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
    import dask

    environ = {**dask.config.get("distributed.nanny.pre-spawn-environ", {}), **WORKER_MALLOC}
    with dask.config.set({"distributed.nanny.pre-spawn-environ": environ, **WORKER_CONFIG}):
        local = LocalCluster(n_workers=int(workers), threads_per_worker=1, processes=True, memory_limit=memory_limit,
                             dashboard_address=None)
    with local, Client(local) as client:
        yield client


def read_chunks(path: str | os.PathLike[str], workers: int | None = None, scheduler: str | None = None,
                chunk_docs: int | None = None) -> int | str | None:
    """The ``chunks`` argument of ``open_traces`` for a command's options.

    In memory (None) for a small file read by one process; lazily, ``chunk_docs``
    documents per chunk (default ``"auto"``), when a cluster is asked for, when
    ``chunk_docs`` is given, or when the file's data exceed :data:`LAZY_ABOVE_BYTES`.

    Parameters
    ----------
    path : str or PathLike
        The trace file (its metadata is read to learn its size).
    workers, scheduler, chunk_docs
        The command's ``--workers``, ``--scheduler`` and ``--chunk-docs``.

    Returns
    -------
    int, "auto" or None

    Raises
    ------
    TypeError
        For a ``path`` that is not a path; an unreadable file gives None, so that
        :func:`protocols.open_traces` reports it (``TraceFileError``).

    Examples
    --------
    >>> read_chunks("traces.zarr", chunk_docs=16)
    16
    """
    if workers is not None or scheduler is not None or chunk_docs is not None:
        return chunk_docs or "auto"
    from pathlib import Path

    path = Path(path)
    if path.suffix.lower() not in (".nc", ".zarr"):
        return None
    kwargs = {"engine": "h5netcdf"} if path.suffix.lower() == ".nc" else {"engine": "zarr", "consolidated": False}
    if not path.exists():
        return None  # open_traces names the missing file
    try:
        with xr.open_dataset(path, chunks={}, **kwargs) as probe:   # metadata only
            big = probe.nbytes > LAZY_ABOVE_BYTES
    except Exception:  # damaged or foreign: open_traces reads it and names the problem (TraceFileError)
        return None
    return "auto" if big else None


def cluster_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Click options ``--workers``, ``--scheduler`` and ``--chunk-docs`` for a command that reads traces.

    Parameters
    ----------
    command : callable
        The click command function; it receives ``workers``, ``scheduler`` and ``chunk_docs``.

    Returns
    -------
    callable
        ``command`` with the three options.

    Raises
    ------
    click.BadParameter
        From click, when the command runs with an option value of the wrong type.

    Examples
    --------
    >>> import click
    >>> @click.command()
    ... @cluster_options
    ... def run(workers, scheduler, chunk_docs):
    ...     pass
    >>> sorted(p.name for p in run.params)
    ['chunk_docs', 'scheduler', 'workers']
    """
    import click  # lazy: only CLI commands take these options; `import protocols` need not load click

    command = click.option("--chunk-docs", type=click.IntRange(min=1), default=None,
                           help="Read the traces lazily, this many documents per chunk (default: in memory for "
                                "files under 2 GiB, else about 64 MiB per chunk).")(command)
    command = click.option("--scheduler", default=None, metavar="ADDRESS",
                           help="Run on an existing dask.distributed scheduler (tcp://host:8786).")(command)
    command = click.option("--workers", type=click.IntRange(min=1), default=None,
                           help="Run on a local dask.distributed cluster of N single-threaded worker "
                                "processes (needs kvdiv[cluster]).")(command)
    return command
