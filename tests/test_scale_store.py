"""protocols.store.TraceStoreWriter: document-by-document writing gives save_traces' file, safely."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

from protocols import TraceValidationError, open_traces, save_traces
from protocols.examples import example_dataset
from protocols.store import StoreError, TraceStoreWriter


@pytest.fixture(scope="module")
def ds():
    return example_dataset("residual", docs=7, policies=3, replicates=5, horizon=9, window=6, seed=4)


def write_in_pieces(path, ds, pieces, **kwargs):
    with TraceStoreWriter(path, **kwargs) as w:
        for sl in pieces:
            w.append(ds.isel(doc=sl))
    return w


@pytest.mark.parametrize("suffix", [".zarr", ".nc"])
def test_pieces_then_append_equal_one_save(ds, tmp_path, suffix):
    path, ref = tmp_path / f"w{suffix}", tmp_path / f"ref{suffix}"
    w = write_in_pieces(path, ds, [[0], [1, 2]])
    assert w.n_docs == 3
    write_in_pieces(path, ds, [[3], [4, 5, 6]], append=True)
    save_traces(ds, ref)
    xr.testing.assert_identical(open_traces(path), open_traces(ref))
    assert open_traces(path).attrs == ds.attrs
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "staging files left behind"


@pytest.mark.parametrize("kind", ["coupled", "reference"])
def test_other_kinds_round_trip(tmp_path, kind):
    ds = example_dataset(kind, docs=4, seed=2)
    path = tmp_path / "t.zarr"
    write_in_pieces(path, ds, [[i] for i in range(4)])
    xr.testing.assert_identical(open_traces(path), ds)


def test_zarr_chunks_are_one_document(ds, tmp_path):
    import zarr

    path = tmp_path / "t.zarr"
    write_in_pieces(path, ds, [[0, 1, 2], [3]])
    arr = zarr.open_group(str(path), mode="r")["shared_tv"]
    assert arr.chunks[0] == 1 and arr.shape[0] == 4


@pytest.mark.parametrize("how", ["writer", "save_traces"])
def test_zarr_arrays_use_shuffle_and_lz4(ds, tmp_path, how):
    import zarr

    path = tmp_path / "t.zarr"
    write_in_pieces(path, ds, [[0, 1]]) if how == "writer" else save_traces(ds, path)
    group = zarr.open_group(str(path), mode="r")
    for name in ds.data_vars:
        (codec,) = group[name].compressors
        assert (codec.cname.value, codec.shuffle.value, codec.typesize) == ("lz4", "shuffle", ds[name].dtype.itemsize)


def test_a_store_with_another_codec_takes_appends(ds, tmp_path, monkeypatch):
    from zarr.codecs import ZstdCodec

    import protocols.io

    path = tmp_path / "t.zarr"
    monkeypatch.setattr(protocols.io, "zarr_compressors", lambda: (ZstdCodec(),))
    write_in_pieces(path, ds, [[0, 1]])                  # a store as zarr's default codec wrote it
    monkeypatch.undo()
    write_in_pieces(path, ds, [[2], [3, 4, 5, 6]], append=True)
    xr.testing.assert_identical(open_traces(path), ds)


def test_an_error_leaves_no_new_file(ds, tmp_path):
    path = tmp_path / "t.zarr"
    with pytest.raises(RuntimeError), TraceStoreWriter(path) as w:
        w.append(ds.isel(doc=[0]))
        raise RuntimeError("collector crashed")
    assert not list(tmp_path.iterdir())


def test_a_failed_append_keeps_the_documents_already_there(ds, tmp_path):
    path = tmp_path / "t.zarr"
    write_in_pieces(path, ds, [[0, 1]])
    with pytest.raises(RuntimeError), TraceStoreWriter(path, append=True) as w:
        w.append(ds.isel(doc=[2, 3]))
        raise RuntimeError("interrupted")
    xr.testing.assert_identical(open_traces(path), ds.isel(doc=[0, 1]))
    write_in_pieces(path, ds, [[2, 3]], append=True)        # and appending works again afterwards
    xr.testing.assert_identical(open_traces(path), ds.isel(doc=[0, 1, 2, 3]))


def test_an_interrupted_store_is_refused(ds, tmp_path):
    import zarr

    path = tmp_path / "t.zarr"
    write_in_pieces(path, ds, [[0, 1]])
    arr = zarr.open_group(str(path), mode="r+")["branch_tv"]
    arr.resize((3,) + arr.shape[1:])                          # as a kill mid-append would leave it
    with pytest.raises(StoreError, match="interrupted"):
        TraceStoreWriter(path, append=True)


def test_each_piece_is_validated(ds, tmp_path):
    bad = ds.isel(doc=[1]).copy(deep=True)
    bad["shared_tv"][0, 0, 0, 0] = 1.5
    with pytest.raises(TraceValidationError, match=r"shared_tv\[doc='doc001'"), \
            TraceStoreWriter(tmp_path / "t.zarr") as w:
        w.append(ds.isel(doc=[0]))
        w.append(bad)


@pytest.mark.parametrize("change, match", [
    (lambda d: d.assign_attrs(horizon=10), "attribute 'horizon'"),
    (lambda d: d.isel(policy=[1, 0, 2]), "coordinate 'policy'"),
    (lambda d: d.isel(replicate=[0, 1]), "coordinate 'replicate'"),
    (lambda d: d.drop_vars("branch_tv"), "variables"),
    (lambda d: d.assign(shared_tv=d["shared_tv"].astype(np.float64)), "variable 'shared_tv'"),
])
def test_pieces_must_match_the_store(ds, tmp_path, change, match):
    with TraceStoreWriter(tmp_path / "t.zarr", validate=False) as w:  # a valid piece may still not fit
        w.append(ds.isel(doc=[0]))
        with pytest.raises(StoreError, match=match):
            w.append(change(ds.isel(doc=[1])))
        w.append(ds.isel(doc=[1]))                           # the writer is still usable
    assert open_traces(tmp_path / "t.zarr").sizes["doc"] == 2


def test_document_ids_must_be_new(ds, tmp_path):
    path = tmp_path / "t.nc"
    write_in_pieces(path, ds, [[0, 1]])
    with TraceStoreWriter(path, append=True, validate=False) as w, pytest.raises(StoreError, match="doc001"):
        w.append(ds.isel(doc=[1, 2]))
    xr.testing.assert_identical(open_traces(path), ds.isel(doc=[0, 1]))


def test_nothing_appended_is_an_error_and_append_needs_a_file(ds, tmp_path):
    with pytest.raises(StoreError, match="no documents"):
        TraceStoreWriter(tmp_path / "t.zarr").close()
    with pytest.raises(FileNotFoundError):
        TraceStoreWriter(tmp_path / "missing.zarr", append=True)
    with pytest.raises(ValueError, match="extension"):
        TraceStoreWriter(tmp_path / "t.h5")


def test_fixed_width_string_ids_append_to_a_store(ds, tmp_path):
    path = tmp_path / "t.zarr"
    piece = ds.isel(doc=[0, 1])
    with TraceStoreWriter(path) as w:
        w.append(piece)
        w.append(piece.assign_coords(doc=np.array(["x0", "x1"])))   # numpy '<U2', as built by hand
    assert [str(d) for d in open_traces(path)["doc"].values] == ["doc000", "doc001", "x0", "x1"]


def test_an_existing_file_is_replaced_only_when_asked_and_only_if_kvdiv_wrote_it(ds, tmp_path):
    path = tmp_path / "t.zarr"
    write_in_pieces(path, ds, [[0]])
    with pytest.raises(FileExistsError, match="overwrite=True"):
        TraceStoreWriter(path)
    write_in_pieces(path, ds, [[1, 2]], overwrite=True)
    xr.testing.assert_identical(open_traces(path), ds.isel(doc=[1, 2]))
    other = tmp_path / "journal.zarr"
    other.mkdir()
    (other / "manifest.json").write_text("{}")
    with pytest.raises(FileExistsError, match="not a trace file kvdiv wrote"):
        TraceStoreWriter(other, overwrite=True)
    assert (other / "manifest.json").exists()
    nc = tmp_path / "t.nc"
    write_in_pieces(nc, ds, [[0]])
    write_in_pieces(nc, ds, [[3]], overwrite=True)
    xr.testing.assert_identical(open_traces(nc), ds.isel(doc=[3]))
