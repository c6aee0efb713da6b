"""Write a trace file document by document, in bounded memory (docs/contract.md §2).

:class:`TraceStoreWriter` appends documents to a Zarr store as they come (one or a
few at a time, each validated), so packing a collection never holds the whole
dataset in memory. The file it leaves is the one ``save_traces`` would write for
the concatenated documents: same layout (one document per chunk), encodings,
variable order and attributes, so ``open_traces`` reads both the same way.

* A new ``.zarr`` is staged under a temporary sibling name and renamed into
  place by :meth:`~TraceStoreWriter.close`; an error (or :meth:`abort`) leaves
  no file under the final name.
* ``append=True`` adds documents to an existing ``.zarr`` in place; on an error
  every array is cut back to its old length, so the documents already there are
  never lost (a process killed mid-write can leave a partly written document at
  the end: reopen with ``append=True`` and the writer refuses until it is fixed).
* ``.nc``: documents are staged in a temporary Zarr store and streamed into the
  NetCDF file chunk by chunk at :meth:`close` (with ``append=True``, the existing
  file's documents first); NetCDF-4 cannot grow a dataset in place through
  xarray, so the file is rewritten, still in bounded memory.

Every piece must agree with the first (or with the existing file) on what makes
the numbers comparable: kind, horizon, window, coupling, sampling, vocab_size,
eos_token_id, model, the policies with their coordinates, replicates and
variables; document ids must be new.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from types import TracebackType

import numpy as np
import xarray as xr

from protocols.errors import ProtocolError
from protocols.io import open_traces, prepare_write, replace_output, written_by_kvdiv
from protocols.schema import eos_ids
from protocols.validate import TV_ZERO_ATOL
from protocols.validate import validate as _validate

__all__ = ["StoreError", "TraceStoreWriter"]

#: Attributes every appended piece must share with the store (as ``protocols.combine`` requires).
SAME_ATTRS = ("schema", "kind", "horizon", "window", "coupling", "sampling", "vocab_size", "eos_token_id", "model")


class StoreError(ProtocolError, ValueError):
    """A piece that cannot be appended to the store (or a store that cannot be appended to), with the reason."""


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def _check_replaceable(path: Path, overwrite: bool) -> None:
    if path.is_symlink():
        raise FileExistsError(f"{path}: is a symbolic link; refusing to write through it")
    if not path.exists():
        return
    if not overwrite:
        raise FileExistsError(f"{path}: exists; pass overwrite=True to replace it, or append=True to add to it")
    if not written_by_kvdiv(path):
        raise FileExistsError(f"{path}: exists and is not a trace file kvdiv wrote; refusing to replace it")


def _doc_dim_arrays(group) -> list[tuple[object, int]]:
    """(zarr array, axis of ``doc``) for every array of the store that runs along ``doc``."""
    out = []
    for _, arr in group.arrays():
        names = tuple(arr.metadata.dimension_names or ())
        if "doc" in names:
            out.append((arr, names.index("doc")))
    return out


class TraceStoreWriter:
    """Append trace documents to a ``.zarr`` (or ``.nc``) file one piece at a time.

    Parameters
    ----------
    path : str or PathLike
        The trace file to write (``.zarr`` or ``.nc``).
    append : bool
        Add documents to the existing file at ``path`` instead of creating it.
    validate : bool
        Validate every piece before it is written (``protocols.validate``).
    tv_atol : float
        Passed to ``validate``.
    overwrite : bool
        Replace an existing file at ``path`` (without ``append``), but only a trace
        file or store that kvdiv wrote, and only at :meth:`close`: until then it
        stays as it was.

    Raises
    ------
    FileNotFoundError
        ``append=True`` and ``path`` does not exist.
    FileExistsError
        ``path`` exists and neither ``append`` nor ``overwrite`` is given; or it is a
        symbolic link, or something kvdiv did not write.
    StoreError
        ``append=True`` on a Zarr store whose arrays disagree on the number of documents.

    Examples
    --------
    >>> from protocols.examples import example_dataset
    >>> import tempfile, pathlib
    >>> ds = example_dataset("residual", docs=3)
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "traces.zarr"
    >>> with TraceStoreWriter(path) as w:
    ...     for i in range(ds.sizes["doc"]):
    ...         w.append(ds.isel(doc=[i]))
    >>> open_traces(path).sizes["doc"]
    3
    """

    def __init__(self, path: str | os.PathLike[str], *, append: bool = False, validate: bool = True,
                 tv_atol: float = TV_ZERO_ATOL, overwrite: bool = False) -> None:
        self.path = Path(path)
        self.format = self.path.suffix.lower()
        if self.format not in (".zarr", ".nc"):
            raise ValueError(f"{self.path}: unknown trace file extension {self.path.suffix!r}; use .zarr or .nc")
        self.append_mode = bool(append)
        self.validate, self.tv_atol = bool(validate), float(tv_atol)
        self.n_docs = 0                    # documents written by this writer
        self._template: xr.Dataset | None = None
        self._doc_ids: set[str] = set()
        self._rollback: int | None = None  # in-place append: the store's doc count before we wrote
        self._closed = False
        in_place = self.append_mode and self.format == ".zarr"
        self._target = self.path if in_place else self.path.with_name(
            f".{self.path.name}.{uuid.uuid4().hex[:8]}.tmp.zarr")
        self._started = False
        if self.append_mode:
            self._load_existing()
        else:
            _check_replaceable(self.path, overwrite)

    # -------------------------------------------------------------- public API

    def append(self, ds: xr.Dataset) -> None:
        """Validate ``ds`` (one or more documents) and write it after the documents already written.

        Raises
        ------
        TraceValidationError
            ``ds`` breaks the trace contract.
        StoreError
            ``ds`` does not match the store (attributes, policies, replicates,
            variables) or repeats a document id.
        """
        if self._closed:
            raise StoreError(f"{self.path}: the writer is closed")
        if self.validate:
            _validate(ds, source=f"(appending to {self.path.name})", tv_atol=self.tv_atol)
        ids = [str(d) for d in ds["doc"].values]
        self._check(ds, ids)
        out, encoding = prepare_write(ds, ".zarr")
        if not self._started:
            out.to_zarr(self._target, mode="w-", zarr_format=3, consolidated=False, encoding=encoding)
            self._started = True
        else:
            out.to_zarr(self._target, mode="a", append_dim="doc", zarr_format=3, consolidated=False)
        if self._template is None:
            self._template = ds.isel(doc=slice(0, 0)).load()
        self._doc_ids.update(ids)
        self.n_docs += len(ids)

    def close(self) -> Path:
        """Finish the file: rename the staged store into place (Zarr) or stream it into the NetCDF file.

        Raises
        ------
        StoreError
            Nothing was appended to a new file (an empty trace file is not written).
        """
        if self._closed:
            return self.path
        try:
            if not self._started and not self.append_mode:
                raise StoreError(f"{self.path}: no documents were appended; nothing written")
            if self.format == ".nc":
                self._write_netcdf()
            elif not self.append_mode:
                replace_output(self._target, self.path)
        except BaseException:
            self.abort()
            raise
        self._closed = True
        if self.format == ".nc" and self._started:
            _remove(self._target)
        return self.path

    def abort(self) -> None:
        """Drop what this writer wrote: the staged store, or (in-place append) the appended documents."""
        if self._closed:
            return
        self._closed = True
        if self._target == self.path:
            self._truncate()
        else:
            _remove(self._target)

    def __enter__(self) -> TraceStoreWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # -------------------------------------------------------------- internals

    def _load_existing(self) -> None:
        if not self.path.exists():
            raise FileNotFoundError(f"{self.path}: no trace file to append to")
        if self.format == ".zarr":
            self._rollback = self._consistent_length()
            self._started = True
        existing = open_traces(self.path, validate=False, chunks=1)
        self._template = existing.isel(doc=slice(0, 0)).load()
        self._doc_ids = {str(d) for d in existing["doc"].values}
        existing.close()

    def _consistent_length(self) -> int:
        """The store's document count; refuses a store whose arrays disagree (an interrupted write)."""
        import zarr

        group = zarr.open_group(str(self.path), mode="r")
        lengths = {arr.name.strip("/"): arr.shape[axis] for arr, axis in _doc_dim_arrays(group)}
        if len(set(lengths.values())) > 1:
            detail = ", ".join(f"{k}: {v}" for k, v in sorted(lengths.items()))
            raise StoreError(f"{self.path}: arrays disagree on the number of documents ({detail}): an earlier "
                             "write was interrupted; cut them back to the shortest length before appending")
        return next(iter(lengths.values()), 0)

    def _check(self, ds: xr.Dataset, ids: list[str]) -> None:
        """``ds`` fits the store: same comparable attrs, policies, replicates, variables; new doc ids."""
        where = f"{self.path.name}"
        dup = sorted(set(ids) & self._doc_ids) or sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise StoreError(f"{where}: document ids already in the store: {dup[:5]}")
        first = self._template
        if first is None:
            return
        for key in SAME_ATTRS:
            if ds.attrs.get(key) != first.attrs.get(key):
                raise StoreError(f"{where}: attribute {key!r} = {ds.attrs.get(key)!r} differs from the store's "
                                 f"{first.attrs.get(key)!r}")
        if eos_ids(ds.attrs) != eos_ids(first.attrs):
            raise StoreError(f"{where}: EOS ids {list(eos_ids(ds.attrs))} differ from the store's "
                             f"{list(eos_ids(first.attrs))}")
        if set(ds.data_vars) != set(first.data_vars):
            raise StoreError(f"{where}: variables {sorted(ds.data_vars)} differ from the store's "
                             f"{sorted(first.data_vars)}")
        for name, var in ds.data_vars.items():
            ref = first[name]
            if var.dims != ref.dims or var.dtype != ref.dtype:
                raise StoreError(f"{where}: variable {name!r} is {var.dims} {var.dtype}, the store's is "
                                 f"{ref.dims} {ref.dtype}")
        for name, coord in first.coords.items():
            if "doc" in coord.dims:
                continue
            if name not in ds.coords or not np.array_equal(ds.coords[name].values, coord.values,
                                                           equal_nan=coord.dtype.kind == "f"):
                raise StoreError(f"{where}: coordinate {name!r} differs from the store's "
                                 f"({coord.values.tolist()[:8]})")

    def _truncate(self) -> None:
        """Cut every doc array of an in-place store back to its length before this writer."""
        if self._rollback is None:
            return
        import zarr

        group = zarr.open_group(str(self.path), mode="r+")
        for arr, axis in _doc_dim_arrays(group):
            if arr.shape[axis] != self._rollback:
                shape = list(arr.shape)
                shape[axis] = self._rollback
                arr.resize(tuple(shape))

    def _write_netcdf(self) -> None:
        """Stream the staged documents (after the existing file's, when appending) into the NetCDF file."""
        parts = []
        if self.append_mode:
            parts.append(open_traces(self.path, validate=False, chunks=1))
        if self._started:
            parts.append(open_traces(self._target, validate=False, chunks=1))
        ds = parts[0] if len(parts) == 1 else xr.concat(
            parts, dim="doc", data_vars="minimal", coords="minimal", compat="override", join="exact",
            combine_attrs="override")
        out, encoding = prepare_write(ds, ".nc")
        tmp = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex[:8]}.tmp.nc")
        try:
            out.to_netcdf(tmp, engine="h5netcdf", invalid_netcdf=False, encoding=encoding)
            for p in parts:
                p.close()
            os.replace(tmp, self.path)
        finally:
            _remove(tmp)
