"""Trace files (docs/contract.md §2): NetCDF-4 (``.nc``, h5netcdf) and Zarr v3 (``.zarr``).

Both formats round-trip values, dtypes, coordinates (string ones included) and
attributes exactly. Writes go to a temporary sibling first and are renamed into
place, so a crash never leaves a half-written file under the final name.
Both are chunked one document per chunk (the unit the collector appends and
divstats resamples) and compressed (NetCDF: shuffle + zlib level 1; Zarr: its
default codec).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import numpy as np
import xarray as xr

from protocols.validate import validate as _validate

__all__ = ["ORDER_ATTR", "SUFFIXES", "open_traces", "save_traces"]

SUFFIXES = (".nc", ".zarr")
#: Attribute holding the variable order while on disk (both backends reorder variables).
ORDER_ATTR = "protocols_variable_order"


def _format(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
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


def _zarr_encoding(ds: xr.Dataset) -> dict[str, dict]:
    enc: dict[str, dict] = {}
    for name, var in ds.variables.items():
        e: dict = {}
        if "doc" in var.dims and var.dtype != object:
            e["chunks"] = tuple(1 if d == "doc" else n for d, n in zip(var.dims, var.shape, strict=True))
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


def save_traces(ds: xr.Dataset, path: str | os.PathLike[str], *, validate: bool = True) -> Path:
    """Write ``ds`` to ``path`` (``.nc`` or ``.zarr``), validating first by default.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace dataset.
    path : str or os.PathLike
        The file; its suffix picks the format. An existing file is replaced
        atomically (written to a temporary sibling, then renamed).
    validate : bool, default True
        Validate ``ds`` before writing anything.

    Returns
    -------
    pathlib.Path
        The path written.

    Raises
    ------
    ValueError
        An unknown suffix.
    TraceValidationError
        ``ds`` breaks the contract (only with ``validate=True``).

    Examples
    --------
    >>> import tempfile, pathlib
    >>> from protocols.examples import example_dataset
    >>> ds = example_dataset()
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     path = save_traces(ds, pathlib.Path(tmp) / "traces.nc")
    ...     open_traces(path).identical(ds)
    True
    """
    path = Path(path)
    fmt = _format(path)
    if validate:
        _validate(ds, source=f"(writing {path.name})")
    ds = _with_order(_clear(ds))
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp{fmt}")
    try:
        if fmt == ".nc":
            ds.to_netcdf(tmp, engine="h5netcdf", invalid_netcdf=False, encoding=_netcdf_encoding(ds))
            os.replace(tmp, path)
        else:
            ds.to_zarr(tmp, mode="w", zarr_format=3, consolidated=False, encoding=_zarr_encoding(ds))
            if path.exists():
                shutil.rmtree(path) if path.is_dir() else path.unlink()
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
    return path


def open_traces(path: str | os.PathLike[str], validate: bool = True) -> xr.Dataset:
    """Load a trace file fully into memory (the file is closed) and validate it by default.

    Parameters
    ----------
    path : str or os.PathLike
        A ``.nc`` or ``.zarr`` trace file.
    validate : bool, default True
        Validate the dataset read.

    Returns
    -------
    xarray.Dataset
        The dataset, with variables in the order they were written and string
        coordinates as object arrays of ``str``.

    Raises
    ------
    FileNotFoundError
        No such file.
    ValueError
        An unknown suffix.
    TraceValidationError
        The file breaks the contract (only with ``validate=True``).

    Examples
    --------
    See :func:`save_traces`.
    """
    path = Path(path)
    fmt = _format(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such trace file")
    if fmt == ".nc":
        with xr.open_dataset(path, engine="h5netcdf") as f:
            ds = f.load()
    else:
        with xr.open_dataset(path, engine="zarr", consolidated=False, chunks=None) as f:
            ds = f.load()
    ds = _restore_order(_strings(_clear(ds)))
    return _validate(ds, source=f"({path.name})") if validate else ds
