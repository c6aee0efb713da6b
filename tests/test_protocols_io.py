"""protocols.io: exact NetCDF / Zarr round trips, validation on load, clear errors."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocols import OutputExistsError, TraceValidationError, open_traces, save_traces
from protocols.examples import example_dataset

ids = st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=8)


def assert_exact(a: xr.Dataset, b: xr.Dataset) -> None:
    xr.testing.assert_identical(a, b)
    for name, var in a.variables.items():
        assert b[name].dtype == var.dtype, (name, b[name].dtype, var.dtype)
        if var.dtype == object:
            assert all(type(v) is str for v in b[name].values.ravel()), name
    assert list(a.attrs) == list(b.attrs)
    assert list(a.data_vars) == list(b.data_vars) and list(a.coords) == list(b.coords)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["coupled", "residual", "reference"]), fmt=st.sampled_from([".nc", ".zarr"]),
       docs=st.lists(ids, min_size=1, max_size=3, unique=True), seed=st.integers(0, 999),
       R=st.integers(1, 4), T=st.integers(1, 7), split=st.sampled_from(["", "exploratory", "confirmatory"]),
       note=st.text(st.characters(blacklist_characters="\x00"), max_size=20))  # HDF5 strings hold no NUL
def test_round_trip_exact(kind, fmt, docs, seed, R, T, split, note):
    ds = example_dataset(kind, docs=docs, policies=2, replicates=R, horizon=T, window=T // 2, seed=seed)
    ds = ds.assign_coords(split=("doc", np.array([split] * len(docs), dtype=object)),
                          request_id=(("doc", "policy"), np.array([[f"{d}/{i}" for i in range(2)] for d in docs],
                                                                  dtype=object)))
    ds.attrs["note"] = note
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"traces{fmt}"
        save_traces(ds, path)
        back = open_traces(path)
    assert_exact(ds, back)


@pytest.mark.parametrize("fmt", [".nc", ".zarr"])
def test_overwrite_and_no_temp_left(tmp_path, fmt):
    path = tmp_path / f"t{fmt}"
    save_traces(example_dataset(seed=1), path)
    with pytest.raises(OutputExistsError, match="exists; pass --overwrite"):
        save_traces(example_dataset(seed=2), path)
    save_traces(example_dataset(seed=2), path, overwrite=True)
    assert_exact(example_dataset(seed=2), open_traces(path))
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def _journal_like(folder: Path) -> dict[str, bytes]:
    folder.mkdir()
    (folder / "manifest.json").write_text('{"format": "kvdiv.collection/1"}')
    (folder / "requests").mkdir()
    (folder / "requests" / "a.ndjson").write_text("{}\n")
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("fmt", [".nc", ".zarr"])
def test_never_replaces_what_kvdiv_did_not_write(tmp_path, fmt):
    ds = example_dataset()
    # A journal (or any folder of other files) under the output's name: kept, even with overwrite.
    run = tmp_path / f"self{fmt}"
    before = _journal_like(run) if fmt == ".zarr" else None
    if fmt == ".nc":
        run.write_bytes(b"precious notes")
    for overwrite in (False, True):
        with pytest.raises(OutputExistsError, match="exists"):
            save_traces(ds, run, overwrite=overwrite)
    if fmt == ".zarr":
        assert {str(p.relative_to(run)): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    else:
        assert run.read_bytes() == b"precious notes"
    # A symbolic link is never written through, whatever it points to.
    target = tmp_path / f"target{fmt}"
    save_traces(ds, target)
    link = tmp_path / f"link{fmt}"
    link.symlink_to(target)
    with pytest.raises(OutputExistsError, match="symbolic link"):
        save_traces(example_dataset(seed=9), link, overwrite=True)
    assert_exact(ds, open_traces(target))
    # A kvdiv store that someone added files to is no longer only ours.
    if fmt == ".zarr":
        (target / "notes.txt").write_text("mine")
        with pytest.raises(OutputExistsError, match="did not write"):
            save_traces(ds, target, overwrite=True)
        assert (target / "notes.txt").read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name or p.name.endswith(".old")]


def test_zarr_is_chunked_along_doc(tmp_path):
    import zarr

    save_traces(example_dataset(docs=3, replicates=2, horizon=5), tmp_path / "t.zarr")
    arr = zarr.open_group(str(tmp_path / "t.zarr"), mode="r")["tv"]
    assert arr.chunks == (1, 2, 2, 5)


def test_netcdf_is_chunked_and_compressed(tmp_path):
    import h5py

    save_traces(example_dataset(docs=3, replicates=2, horizon=5), tmp_path / "t.nc")
    with h5py.File(tmp_path / "t.nc") as f:
        assert f["tv"].chunks == (1, 2, 2, 5) and f["tv"].compression == "gzip" and f["tv"].shuffle


@pytest.mark.parametrize("fmt", [".nc", ".zarr"])
def test_loading_validates(tmp_path, fmt):
    ds = example_dataset(seed=4)
    ds.tv.values[0, 0, 0, 0] = 2.0
    path = tmp_path / f"bad{fmt}"
    save_traces(ds, path, validate=False)
    with pytest.raises(TraceValidationError, match=rf"\(bad{fmt}\)") as info:
        open_traces(path)
    assert any(p.startswith("tv:") for p in info.value.problems)
    assert open_traces(path, validate=False).tv.values[0, 0, 0, 0] == 2.0


def test_saving_validates(tmp_path):
    ds = example_dataset(seed=4)
    ds.attrs["kind"] = "crude"
    with pytest.raises(TraceValidationError, match="'kind'"):
        save_traces(ds, tmp_path / "t.nc")
    assert not list(tmp_path.iterdir())


def test_unknown_extension(tmp_path):
    with pytest.raises(ValueError, match=r"unknown trace file extension '\.csv'"):
        save_traces(example_dataset(), tmp_path / "t.csv")
    with pytest.raises(ValueError, match="unknown trace file extension"):
        open_traces(tmp_path / "t.h5")


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such trace file"):
        open_traces(tmp_path / "nope.nc")
