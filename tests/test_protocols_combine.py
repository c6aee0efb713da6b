"""protocols.combine: along doc, policy and model, with the consistency checks."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

from protocols import combine, open_traces, save_traces
from protocols.combine import CombineError
from protocols.examples import example_dataset
from protocols.validate import validate


@pytest.fixture(params=["coupled", "residual", "reference"])
def full(request):
    ds = example_dataset(request.param, docs=4, policies=3, replicates=3, horizon=6, window=2, seed=11)
    return ds.assign_coords(split=("doc", np.array(["exploratory", "", "confirmatory", ""], dtype=object)),
                            retained_tokens=(("doc", "policy"), np.arange(12, dtype=np.int32).reshape(4, 3)))


def test_doc_pieces_recombine_exactly(full):
    pieces = [full.isel(doc=[0, 1]), full.isel(doc=[2]), full.isel(doc=[3])]
    xr.testing.assert_identical(combine(pieces, "doc"), full)


def test_policy_pieces_recombine_exactly(full):
    pieces = [full.isel(policy=[i]) for i in range(3)]
    xr.testing.assert_identical(combine(pieces, "policy"), full)


def test_other_dim_is_aligned_by_id(full):
    a, b = full.isel(policy=[0, 1]), full.isel(policy=[2])
    b = b.isel(doc=[3, 2, 1, 0])                  # same docs, other order
    xr.testing.assert_identical(combine([a, b], "policy"), full)


def test_cells_from_assemble_style_pieces(full):
    cells = [[full.isel(doc=[d], policy=[p]) for p in range(3)] for d in range(4)]
    rows = [combine(row, "policy") for row in cells]
    xr.testing.assert_identical(combine(rows, "doc"), full)


def test_duplicate_ids_refused(full):
    with pytest.raises(CombineError, match="duplicate doc id 'doc001' in datasets 0 and 1"):
        combine([full.isel(doc=[0, 1]), full.isel(doc=[1, 2])], "doc")


@pytest.mark.parametrize("attr, value", [("horizon", 7), ("window", 1), ("vocab_size", 99), ("kind", "crude"),
                                         ("sampling", '{"temperature": 0.5}')])
def test_inconsistent_attrs_refused(full, attr, value):
    b = full.isel(doc=[3]).copy()
    b.attrs[attr] = value
    with pytest.raises(CombineError, match=f"attribute '{attr}'"):
        combine([full.isel(doc=[0]), b], "doc")


def test_different_replicates_refused(full):
    with pytest.raises(CombineError, match="replicates"):
        combine([full.isel(doc=[0]), full.isel(doc=[1], replicate=[0, 1])], "doc")


def test_different_other_ids_refused(full):
    with pytest.raises(CombineError, match=r"policy ids differ .*missing \['recent@0.5'\]"):
        combine([full.isel(doc=[0]), full.isel(doc=[1], policy=[0, 1])], "doc")


def test_conflicting_per_doc_coord_refused(full):
    b = full.isel(policy=[2]).assign_coords(prompt_tokens=("doc", np.zeros(4, dtype=np.int32)))
    with pytest.raises(CombineError, match="per-doc coordinate 'prompt_tokens'"):
        combine([full.isel(policy=[0, 1]), b], "policy")


def test_missing_variable_refused(full):
    with pytest.raises(CombineError, match="missing \\['retained_tokens'\\]"):
        combine([full.isel(doc=[0]), full.isel(doc=[1]).drop_vars("retained_tokens")], "doc")


def test_attrs_merged(full):
    a, b = full.isel(doc=[0]).copy(), full.isel(doc=[1]).copy()
    a.attrs.update(producer="gen_service 0.1", run="x")
    b.attrs.update(producer="foreign tool", run="y")
    out = combine([a, b])
    assert out.attrs["producer"] == "gen_service 0.1; foreign tool"
    assert "run" not in out.attrs


def test_model_dim(tmp_path):
    a = example_dataset(docs=2, policies=2, replicates=3, horizon=5, vocab_size=5, eos_token_id=4, model="m-small",
                        seed=1)
    b = example_dataset(docs=2, policies=2, replicates=3, horizon=5, vocab_size=9, eos_token_id=8, model="m-big",
                        seed=2)
    out = combine([a, b], "model")
    assert out.tv.dims == ("model", "doc", "policy", "replicate", "step")
    assert list(out.model.values) == ["m-small", "m-big"]
    assert list(out.vocab_size.values) == [5, 9] and list(out.eos_token_id.values) == [4, 8]
    assert out.attrs["vocab_size"] == 9 and out.attrs["eos_token_id"] == -1 and out.attrs["model"] == "m-small, m-big"
    big = out.sel(model="m-big", drop=True)       # drops the per-model coords too
    xr.testing.assert_equal(big, b)
    np.testing.assert_array_equal(out.x_token.sel(model="m-big").values, b.x_token.values)
    validate(out)
    for fmt in (".nc", ".zarr"):
        save_traces(out, tmp_path / f"models{fmt}")
        xr.testing.assert_identical(open_traces(tmp_path / f"models{fmt}"), out)


def test_model_names_must_differ():
    a = example_dataset(seed=1)
    with pytest.raises(CombineError, match="distinct"):
        combine([a, example_dataset(seed=2)], "model")
    assert combine([a, example_dataset(seed=2)], "model", models=["a", "b"]).sizes["model"] == 2


def test_bad_dim():
    with pytest.raises(ValueError, match="dim must be one of"):
        combine([example_dataset()], "replicate")


def test_models_with_their_own_prompt_lengths_combine_per_model():
    """Two models tokenize a document into different numbers of tokens: along ``model``,
    ``prompt_tokens`` becomes (model, doc), each model's own, and the result validates;
    equal lengths stay per doc."""
    a = example_dataset(docs=["a", "b"], seed=1).assign_attrs(model="m1")
    b = example_dataset(docs=["b", "a"], seed=2).assign_attrs(model="m2")
    b = b.assign_coords(prompt_tokens=("doc", [400, 300]))
    both = combine([a, b], "model")
    assert both["prompt_tokens"].dims == ("model", "doc")
    assert both["prompt_tokens"].sel(model="m2", doc="a").item() == 300
    assert both["prompt_tokens"].sel(model="m1").values.tolist() == a["prompt_tokens"].values.tolist()
    validate(both)
    same = combine([a, a.assign_attrs(model="m3")], "model")
    assert same["prompt_tokens"].dims == ("doc",)
