"""divstats with EOS sets (issue 21 item 1): every id of ``eos_token_ids`` ends a side.

A simulated single-EOS dataset is relabelled: in every odd replicate EOS 2 becomes
token 4 in both sides (a bijection within the replicate, so every per-replicate
value is unchanged). Declared as the set {2, 4}, the estimates equal the original
ones; declared with 2 alone, the rows ending on 4 no longer count as ended, so the
tail capacity grows. A file with only ``eos_token_id`` still opens and analyses.
"""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr
from divstats_cases import CASE_IDS, CASES

import divstats as dv
from protocols import combine, open_traces, save_traces, validate

TOKENS = ("x_token", "y_token", "shared_token", "branch_x_token", "branch_y_token")


def _source(kind: str) -> xr.Dataset:
    c = CASES[CASE_IDS.index("early_eos")]
    return dv.simulate(c.p, c.q, 3, 4, 400, kind=kind, window=1 if kind == "residual" else None, seed=8, eos=2)


def _relabel(ds: xr.Dataset, eos_token_ids: list[int] | None) -> xr.Dataset:
    odd = (ds.replicate % 2 == 1)
    out = ds.copy()
    for name in TOKENS:
        if name in ds:
            out[name] = ds[name].where(~(odd & (ds[name] == 2)), 4).astype(ds[name].dtype)
    attrs = {**ds.attrs, "vocab_size": 5}
    if eos_token_ids is not None:
        attrs["eos_token_ids"] = eos_token_ids
    out.attrs = attrs
    return out


@pytest.mark.parametrize("kind", ["coupled", "residual"])
def test_every_eos_id_ends_a_side(kind: str) -> None:
    src = _source(kind)
    w = 1 if kind == "coupled" else None
    ref = dv.estimate(src, window=w)
    relabelled = validate(_relabel(src, [2, 4]))
    est = dv.estimate(relabelled, window=w)
    for name in ("occurrence", "post_mismatch", "window_mismatch", "tail_capacity", "loss_upper"):
        if name in ref:
            np.testing.assert_allclose(est[name].values, ref[name].values, rtol=1e-12, err_msg=name)
    only_first = dv.estimate(_relabel(src, None), window=w)
    assert float(only_first.tail_capacity.values.ravel()[0]) > float(ref.tail_capacity.values.ravel()[0])
    # per-model sets after combining across models
    both = combine([relabelled.assign_attrs(model="a"), _relabel(src, None).assign_attrs(model="b")], dim="model")
    assert both.eos_token_ids.values.tolist() == [[2, 4], [2, -1]]
    per = dv.estimate(both, window=w)
    np.testing.assert_allclose(per.tail_capacity.sel(model="a").values, ref.tail_capacity.values, rtol=1e-12)
    np.testing.assert_allclose(per.tail_capacity.sel(model="b").values, only_first.tail_capacity.values,
                               rtol=1e-12)


def test_single_eos_file_opens_and_analyses(tmp_path) -> None:
    src = _source("residual")
    assert "eos_token_ids" not in src.attrs
    back = open_traces(save_traces(src, tmp_path / "single.nc"))
    xr.testing.assert_allclose(dv.estimate(back).tail_capacity, dv.estimate(src).tail_capacity)
    multi = open_traces(save_traces(_relabel(src, [2, 4]), tmp_path / "multi.nc"))
    assert list(multi.attrs["eos_token_ids"]) == [2, 4]
    xr.testing.assert_allclose(dv.estimate(multi).tail_capacity, dv.estimate(src).tail_capacity)
