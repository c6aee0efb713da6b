"""validate on dask-backed datasets: chunk by chunk, the same problems as in memory."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr
from click.testing import CliRunner
from test_protocols_validate import CASES, broken, coupled_base

from protocols import TraceValidationError, open_traces, save_traces, validate
from protocols.chunks import is_lazy, read_chunks
from protocols.cli import validate as validate_cmd
from protocols.examples import example_dataset


def problems(ds: xr.Dataset) -> list[tuple[str, dict]]:
    try:
        validate(ds)
    except TraceValidationError as err:
        return [(str(p), p.where) for p in err.problems]
    return []


@pytest.mark.parametrize("name", list(CASES))
def test_every_rule_reports_the_same_per_chunk(name):
    kind, edit, _ = CASES[name]
    ds = broken(kind, edit)
    lazy = ds.chunk(doc=1)
    assert is_lazy(lazy)
    assert problems(lazy) == problems(ds) != []


def test_counts_add_up_and_the_first_example_is_the_datasets():
    ds = example_dataset("coupled", docs=9, policies=2, replicates=3, horizon=6, seed=1).copy(deep=True)
    ds.tv.values[7, 1, 2, 3] = 1.5          # later chunk first: the example must still be doc 2's
    ds.tv.values[2, 0, 0, 4] = 1.25
    ds.tv.values[8, 0, 1, 1] = -0.5
    mem = problems(ds)
    assert problems(ds.chunk(doc=2)) == mem
    assert problems(ds.chunk(doc=4)) == mem
    assert mem[0][0].startswith("tv: 3 value(s) outside [0, 1], e.g. tv[doc='doc002'")
    assert mem[0][1] == {"doc": "doc002", "policy": "snapkv@0.5", "replicate": 0, "step": 5}


def test_model_dim_first_example_across_chunks():
    a, b = coupled_base(), coupled_base()
    ds = xr.concat([a, b], dim="model").assign_coords(
        model=["m1", "m2"], vocab_size=("model", [5, 9]), eos_token_id=("model", [4, 8]))
    ds.attrs["vocab_size"] = 9
    ds.x_token.values[1, 0, 0, 0, 0] = 7        # legal for m2
    ds.x_token.values[0, 1, 0, 0, 0] = 7        # illegal for m1, in the second doc chunk
    ds.y_token.values[1, 0, 1, 0, 0] = 11       # illegal for m2, in the first doc chunk
    mem = problems(ds)
    assert problems(ds.chunk(doc=1)) == mem
    assert any("x_token[model='m1', doc='d1'" in p for p, _ in mem)


@pytest.mark.parametrize("suffix", [".zarr", ".nc"])
def test_open_lazily_validates_per_chunk(tmp_path, suffix):
    ds = example_dataset("residual", docs=5, seed=3).copy(deep=True)
    path = tmp_path / f"t{suffix}"
    save_traces(ds, path)
    assert is_lazy(open_traces(path, chunks=2))
    ds.shared_tv.values[4, 0, 0, 0] = 2.0
    bad = tmp_path / f"bad{suffix}"
    save_traces(ds, bad, validate=False)
    with pytest.raises(TraceValidationError) as info:
        open_traces(bad, chunks=2)
    assert problems(ds) == [(str(p), p.where) for p in info.value.problems]


def test_cli_validate_reads_chunks_and_reports_every_problem(tmp_path):
    ds = example_dataset("coupled", docs=4, seed=2).copy(deep=True)
    path = tmp_path / "t.zarr"
    save_traces(ds, path)
    assert read_chunks(path) is None                     # small file, no options: in memory
    assert read_chunks(path, chunk_docs=3) == 3
    assert read_chunks(path, workers=2) == "auto"
    res = CliRunner().invoke(validate_cmd, [str(path), "--chunk-docs", "1"])
    assert res.exit_code == 0 and res.output.startswith("ok: coupled, 4 docs"), res.output
    ds.tv.values[3, 0, 0, 0] = np.nan
    bad = tmp_path / "bad.zarr"
    save_traces(ds, bad, validate=False)
    res = CliRunner().invoke(validate_cmd, [str(bad), "--chunk-docs", "1"])
    assert res.exit_code == 1 and "tv[doc='doc003'" in res.output, res.output
