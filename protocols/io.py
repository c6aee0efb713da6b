"""Trace files (docs/contract.md §2): NetCDF-4 (``.nc``, h5netcdf) and Zarr v3 (``.zarr``).

Both formats round-trip values, dtypes, coordinates (string ones included) and
attributes exactly. Writes go to a temporary sibling first and are renamed into
place, so a crash never leaves a half-written file under the final name. An output
that exists is refused unless ``overwrite=True``, and even then only a file or store
that kvdiv wrote (it carries the ``protocols_variable_order`` attribute) is replaced:
a journal, a folder of other files or a symbolic link never is.
Both are chunked one document per chunk (the unit the collector appends and
divstats resamples) and compressed (NetCDF: shuffle + zlib level 1; Zarr: byte
shuffle + LZ4 through Blosc, see :func:`zarr_compressors`).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import xarray as xr

from protocols.errors import ProtocolError
from protocols.validate import validate as _validate

__all__ = ["ORDER_ATTR", "SUFFIXES", "OutputExistsError", "TraceFileError", "open_traces", "save_traces"]

SUFFIXES = (".nc", ".zarr")
#: Attribute holding the variable order while on disk (both backends reorder variables).
ORDER_ATTR = "protocols_variable_order"


class OutputExistsError(ProtocolError, FileExistsError, ValueError):
    """An output path that exists (or is a symbolic link) and may not be replaced."""


class TraceFileError(ProtocolError, ValueError):
    """A trace file that the NetCDF or Zarr backend cannot read (damaged, or something else)."""


def written_by_kvdiv(path: Path) -> bool:
    """Whether ``path`` is a trace file or store that kvdiv wrote (its marker attribute, nothing else inside).

    Shared by :func:`save_traces` and :class:`protocols.store.TraceStoreWriter`: the
    one test of what kvdiv may replace.
    """
    if path.suffix.lower() == ".nc":
        if not path.is_file():
            return False
        try:
            import h5py

            with h5py.File(path, "r") as f:
                return ORDER_ATTR in f.attrs
        except (OSError, ValueError):
            return False
    if not path.is_dir():
        return False
    # A store holds zarr.json and one folder per variable; anything else (a journal's
    # manifest.json, someone's notes) means the folder is more than our store.
    stray = [p for p in path.iterdir() if p.is_file() and p.name != "zarr.json"]
    try:
        meta = json.loads((path / "zarr.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return not stray and isinstance(meta, dict) and ORDER_ATTR in (meta.get("attributes") or {})


def _check_replaceable(path: Path, overwrite: bool) -> None:
    if path.is_symlink():
        raise OutputExistsError(f"{path}: is a symbolic link; refusing to write through it (choose another path)")
    if not path.exists():
        return
    if not overwrite:
        raise OutputExistsError(f"{path}: exists; pass --overwrite (overwrite=True) to replace a kvdiv output")
    if not written_by_kvdiv(path):
        what = "a folder" if path.is_dir() else "a file"
        raise OutputExistsError(f"{path}: exists and is {what} kvdiv did not write (no {ORDER_ATTR} attribute); "
                                "refusing to replace it even with --overwrite")


def replace_output(tmp: Path, path: Path) -> None:
    """Rename ``tmp`` over ``path``; a store (a directory) is moved aside first, then removed."""
    if tmp.is_dir() and path.exists():
        old = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.old")
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)


#: Suffixes of inputs that ``kvdiv convert`` turns into trace files.
CONVERTIBLE = (".jsonl", ".json")


def not_a_trace_file(path: str | os.PathLike[str]) -> str:
    """Why ``path`` is not read as traces, and, for an input from elsewhere, the command that converts it.

    Parameters
    ----------
    path : path
        A file or folder that is not a ``.nc`` / ``.zarr`` trace file.

    Returns
    -------
    str
        One line.

    Raises
    ------
    None

    Examples
    --------
    >>> not_a_trace_file("eval.jsonl").split(";")[0]
    'eval.jsonl: not a trace file (.nc or .zarr)'
    >>> not_a_trace_file("eval.jsonl").endswith("`kvdiv convert eval.jsonl -o eval.nc`")
    True
    """
    p = Path(path)
    if p.suffix.lower() in CONVERTIBLE or (p.is_dir() and p.suffix.lower() not in SUFFIXES):
        return (f"{p}: not a trace file (.nc or .zarr); an evaluation log, OpenAI-format responses, answer rows or "
                f"kvpress results are converted first: `kvdiv convert {p} -o {p.with_suffix('.nc').name}`")
    return f"{p}: unknown trace file extension {p.suffix!r}; use one of {SUFFIXES}"


def _format(path: Path, *, reading: bool = False) -> str:
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        if reading:   # an input from elsewhere gets the command that converts it
            raise ValueError(not_a_trace_file(path))
        raise ValueError(f"{path}: unknown trace file extension {path.suffix!r}; use one of {SUFFIXES}")
    return suffix


def _strings(ds: xr.Dataset) -> xr.Dataset:
    """Make every string-valued variable a plain object array of ``str``.

    Backends hand strings back as fixed-width ``<U``, numpy StringDType or bytes
    depending on format and version; the contract's in-memory form is object.
    """
    fixes = {}
    for name, var in ds.variables.items():
        kind = var.dtype.kind
        if kind in ("U", "S", "T") or (kind == "O" and var.size and isinstance(var.values.flat[0], bytes)):
            vals = np.array([v.decode() if isinstance(v, bytes) else str(v) for v in var.values.ravel()],
                            dtype=object).reshape(var.shape)
            fixes[name] = xr.Variable(var.dims, vals, attrs=var.attrs)
    for name, var in fixes.items():
        if name in ds.coords:
            ds = ds.assign_coords({name: var})
        else:
            ds[name] = var
    return ds


def zarr_compressors() -> tuple:
    """The codec of a trace store's per-document arrays: Blosc, byte shuffle + LZ4 (level 5).

    Reading is what a lazy analysis pays for (each chunk is decompressed by the task
    that analyses it), so the codec is chosen for decompression speed: on residual
    traces shuffle + LZ4 decompressed a chunk in about 60% of the CPU time of zarr's
    default (zstd) and gave a slightly smaller store (benchmarks/bench_scale.py,
    docs/scale.md).

    Returns
    -------
    tuple
        The ``compressors`` entry of a Zarr v3 variable encoding.

    Examples
    --------
    >>> zarr_compressors()[0].cname.value
    'lz4'
    """
    from zarr.codecs import BloscCodec

    return (BloscCodec(cname="lz4", clevel=5, shuffle="shuffle"),)


def _zarr_encoding(ds: xr.Dataset) -> dict[str, dict]:
    enc: dict[str, dict] = {}
    for name, var in ds.variables.items():
        e: dict = {}
        if "doc" in var.dims and var.dtype != object:
            e["chunks"] = tuple(1 if d == "doc" else n for d, n in zip(var.dims, var.shape, strict=True))
            e["compressors"] = zarr_compressors()
        if var.dtype.kind == "f":
            e["fill_value"] = np.nan     # keep NaN a value, not a mask sentinel clash
        enc[name] = e
    return enc


def _with_order(ds: xr.Dataset) -> xr.Dataset:
    ds = ds.copy(deep=False)
    ds.attrs = {**ds.attrs, ORDER_ATTR: json.dumps({"data_vars": list(ds.data_vars), "coords": list(ds.coords)})}
    return ds


def _restore_order(ds: xr.Dataset) -> xr.Dataset:
    """Put variables back in the order they were written (files from elsewhere are left as read)."""
    attrs = dict(ds.attrs)
    order = attrs.pop(ORDER_ATTR, None)
    if order is None:
        return ds
    order = json.loads(order)
    data = [n for n in order["data_vars"] if n in ds.data_vars]
    data += [n for n in ds.data_vars if n not in data]
    coords = [n for n in order["coords"] if n in ds.coords]
    coords += [n for n in ds.coords if n not in coords]
    return xr.Dataset({n: ds[n].variable for n in data}, coords={n: ds[n].variable for n in coords}, attrs=attrs)


def _netcdf_encoding(ds: xr.Dataset) -> dict[str, dict]:
    """Per-doc chunks, shuffle + zlib level 1: several times smaller files for a few % more time."""
    enc: dict[str, dict] = {}
    for name, var in ds.data_vars.items():
        if "doc" in var.dims and var.dtype != object and var.size:
            enc[name] = {"zlib": True, "complevel": 1, "shuffle": True,
                         "chunksizes": tuple(1 if d == "doc" else n for d, n in zip(var.dims, var.shape, strict=True))}
    return enc


def _clear(ds: xr.Dataset) -> xr.Dataset:
    """Drop encodings carried over from a file we read, so writing is deterministic."""
    ds = ds.copy(deep=False)
    for var in ds.variables.values():
        var.encoding = {}
    return ds


def save_traces(ds: xr.Dataset, path: str | os.PathLike[str], *, validate: bool = True,
                overwrite: bool = False) -> Path:
    """Write ``ds`` to ``path`` (``.nc`` or ``.zarr``), validating first by default.

    Parameters
    ----------
    ds : xarray.Dataset
        The traces.
    path : path
        Output file (``.nc``) or store (``.zarr``).
    validate : bool
        Check the contract first.
    overwrite : bool
        Replace an existing output, but only one that kvdiv wrote.

    Returns
    -------
    Path
        ``path``.

    Raises
    ------
    OutputExistsError
        ``path`` is a symbolic link, or exists and ``overwrite`` is false, or exists
        and was not written by kvdiv (a journal, another program's file or folder).
    TraceValidationError
        If ``validate`` and ``ds`` breaks the contract.

    Examples
    --------
    >>> import tempfile
    >>> from protocols.examples import example_dataset
    >>> out = Path(tempfile.mkdtemp()) / "t.nc"
    >>> save_traces(example_dataset(), out).name
    't.nc'
    >>> save_traces(example_dataset(), out)
    Traceback (most recent call last):
    protocols.io.OutputExistsError: ...t.nc: exists; pass --overwrite (overwrite=True) to replace a kvdiv output
    """
    path = Path(path)
    fmt = _format(path)
    _check_replaceable(path, overwrite)
    if validate:
        _validate(ds, source=f"(writing {path.name})")
    ds = _with_order(_clear(ds))
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp{fmt}")
    try:
        if fmt == ".nc":
            ds.to_netcdf(tmp, engine="h5netcdf", invalid_netcdf=False, encoding=_netcdf_encoding(ds))
        else:
            ds.to_zarr(tmp, mode="w", zarr_format=3, consolidated=False, encoding=_zarr_encoding(ds))
        _check_replaceable(path, overwrite)  # again: something may have appeared while writing
        replace_output(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
    return path


def open_traces(path: str | os.PathLike[str], validate: bool = True, *,
                chunks: int | str | Mapping[str, int] | None = None) -> xr.Dataset:
    """Open a trace file and validate it by default.

    Parameters
    ----------
    path : str or os.PathLike
        A ``.nc`` or ``.zarr`` trace file.
    validate : bool, default True
        Check the contract (``protocols.validate``; chunk by chunk when lazy).
    chunks : int, "auto", mapping or None
        None (default): load everything into memory and close the file.  Otherwise
        open lazily as a dask-backed dataset chunked along ``doc`` only: an int is
        the documents per chunk, ``"auto"`` picks about :data:`AUTO_CHUNK_BYTES` of
        data per chunk, ``{"doc": n}`` is the same as ``n``.  Needs dask.

    Returns
    -------
    xarray.Dataset
        The dataset, with variables in the order they were written and string
        coordinates as object arrays of ``str``; dask-backed when ``chunks`` is given.

    Raises
    ------
    FileNotFoundError
        No such file.
    ValueError
        An unknown suffix.
    TraceFileError
        The backend cannot read the file (damaged, or another program's).
    TraceValidationError
        The file breaks the contract (only with ``validate=True``).

    Examples
    --------
    >>> import tempfile
    >>> from protocols.examples import example_dataset
    >>> out = save_traces(example_dataset(), Path(tempfile.mkdtemp()) / "t.nc")
    >>> open_traces(out).identical(example_dataset())
    True
    >>> ds = open_traces("traces.zarr", chunks="auto")   # doctest: +SKIP
    """
    path = Path(path)
    fmt = _format(path, reading=True)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such trace file")
    if chunks is not None:
        return _open_lazy(path, fmt, chunks, validate)
    try:
        if fmt == ".nc":
            with xr.open_dataset(path, engine="h5netcdf") as f:
                ds = f.load()
        else:
            with xr.open_dataset(path, engine="zarr", consolidated=False, chunks=None) as f:
                ds = f.load()
    except Exception as exc:  # h5py, zarr and json each fail their own way on a damaged file
        raise TraceFileError(f"{path}: not a readable {fmt} file ({type(exc).__name__}: {exc})") from None
    ds = _restore_order(_strings(_clear(ds)))
    return _validate(ds, source=f"({path.name})") if validate else ds


# ----------------------------------------------------------------------------- piecewise writing

def prepare_write(ds: xr.Dataset, fmt: str) -> tuple[xr.Dataset, dict[str, dict]]:
    """``ds`` as it goes to disk (encodings cleared, variable order recorded) and its encoding for ``fmt``.

    The one layout of a trace file, shared by ``save_traces``-style whole writes and
    ``protocols.store.TraceStoreWriter``'s document-by-document appends.

    Parameters
    ----------
    ds : xarray.Dataset
        Trace dataset.
    fmt : str
        ``".nc"`` or ``".zarr"``.

    Returns
    -------
    (xarray.Dataset, dict)
        The dataset to write and the ``encoding`` argument for ``to_netcdf`` / ``to_zarr``.

    Raises
    ------
    ValueError
        For an unknown format.

    Examples
    --------
    >>> from protocols.examples import example_dataset
    >>> out, enc = prepare_write(example_dataset(), ".zarr")
    >>> enc["tv"]["chunks"][0]
    1
    """
    if fmt not in SUFFIXES:
        raise ValueError(f"unknown trace file format {fmt!r}; use one of {SUFFIXES}")
    ds = _with_order(_clear(_strings(ds)))   # strings as object arrays: one on-disk string type for every piece
    return ds, (_netcdf_encoding(ds) if fmt == ".nc" else _zarr_encoding(ds))


# ----------------------------------------------------------------------------- lazy (dask-backed) open

#: ``chunks="auto"``: documents per chunk chosen so that one chunk holds about this many bytes of data.
AUTO_CHUNK_BYTES = 64 * 2**20


def docs_per_chunk(ds: xr.Dataset, chunks: int | str | Mapping[str, int]) -> int:
    """Documents per dask chunk for ``chunks`` (an int, ``"auto"`` or ``{"doc": n}``), at least 1.

    Parameters
    ----------
    ds : xarray.Dataset
        The trace dataset (lazy is fine: only sizes and dtypes are used).
    chunks : int, "auto" or mapping
        As for :func:`open_traces`.

    Returns
    -------
    int

    Raises
    ------
    ValueError
        For anything else, or a mapping naming a dim other than ``doc``.

    Examples
    --------
    >>> docs_per_chunk(xr.Dataset(), {"doc": 8})
    8
    """
    if isinstance(chunks, Mapping):
        extra = sorted(set(chunks) - {"doc"})
        if extra or "doc" not in chunks:
            raise ValueError(f"chunks={dict(chunks)!r}: trace datasets are chunked along 'doc' only")
        chunks = chunks["doc"]
    if chunks == "auto":
        n_docs = max(1, int(ds.sizes.get("doc", 1)))
        per_doc = sum(v.dtype.itemsize * v.size for v in ds.data_vars.values() if "doc" in v.dims) / n_docs
        return max(1, int(AUTO_CHUNK_BYTES // max(per_doc, 1)))
    if isinstance(chunks, bool) or not isinstance(chunks, (int, np.integer)) or chunks < 1:
        raise ValueError(f"chunks={chunks!r}: expected documents per chunk (an int >= 1), 'auto' or {{'doc': n}}")
    return int(chunks)


def _open_lazy(path: Path, fmt: str, chunks: int | str | Mapping[str, int], validate: bool) -> xr.Dataset:
    """Dask-backed dataset over the open file, chunked along ``doc``; small coordinates in memory."""
    kwargs = {"engine": "h5netcdf"} if fmt == ".nc" else {"engine": "zarr", "consolidated": False}
    probe = xr.open_dataset(path, chunks={}, **kwargs)
    n = docs_per_chunk(probe, chunks)
    probe.close()
    with warnings.catch_warnings():
        # small coordinates stored in one piece are "split" by doc chunks; they are loaded below
        warnings.filterwarnings("ignore", message="The specified chunks separate the stored chunks")
        ds = xr.open_dataset(path, chunks={"doc": n}, **kwargs)
    # coordinates (ids, split labels, budgets) are small: in memory, so labels never trigger a read
    ds = ds.assign_coords({name: c.variable.load() for name, c in ds.coords.items()})
    ds = _restore_order(_strings(_clear(ds)))
    return _validate(ds, source=f"({path.name})") if validate else ds
