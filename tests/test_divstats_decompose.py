"""Gap decomposition (docs/statistics.md §3): exactness, hand computation, pairing, bootstrap coverage."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

import divstats
from divstats.calibration.coverage import decomposition_coverage
from divstats.inference.decompose import ATTRIBUTIONS, decompose
from divstats.truth.studies import PolicyEffect, simulate_study


def estimates(occ, exp_, post, horizon=10, docs=None, policies=("A", "B")):
    occ, exp_, post = (np.asarray(x, dtype=float) for x in (occ, exp_, post))
    docs = docs or [f"d{i}" for i in range(occ.shape[0])]
    dims = ("doc", "policy")
    return xr.Dataset({"occurrence": (dims, occ), "exposure": (dims, exp_), "post_mismatch": (dims, post)},
                      coords={"doc": docs, "policy": list(policies)}, attrs={"horizon": horizon})


def test_hand_computed_shapley_and_ordered_parts():
    # Two documents, T = 10. Aggregates: o_A = 0.5, o_B = 0.3; e_A = 3, e_B = 1;
    # post_A = 0.6 -> rho_A = 0.2; post_B = 0.5 -> rho_B = 0.5.
    est = estimates(occ=[[0.6, 0.4], [0.4, 0.2]], exp_=[[4, 1.5], [2, 0.5]], post=[[0.8, 0.6], [0.4, 0.4]])
    r = decompose(est, "A", "B")
    T = 10
    m_a, m_b = (0.5 + 0.6) / T, (0.3 + 0.5) / T
    assert r.mismatch_a == pytest.approx(m_a) and r.mismatch_b == pytest.approx(m_b)
    assert r.gap == pytest.approx(m_a - m_b)
    assert r.first == pytest.approx((0.5 - 0.3) / T)
    assert r.exposure == pytest.approx((3 - 1) * (0.2 + 0.5) / (2 * T))
    assert r.rate == pytest.approx((0.2 - 0.5) * (3 + 1) / (2 * T))
    ef, rf = r.ordered["exposure-first"], r.ordered["rate-first"]
    assert ef.exposure == pytest.approx((3 - 1) * 0.5 / T) and ef.rate == pytest.approx((0.2 - 0.5) * 3 / T)
    assert rf.rate == pytest.approx((0.2 - 0.5) * 1 / T) and rf.exposure == pytest.approx((3 - 1) * 0.2 / T)
    # Shapley is the average of the two orders.
    assert r.exposure == pytest.approx((ef.exposure + rf.exposure) / 2)
    assert r.shares.first == pytest.approx(r.first / r.gap)
    assert r.shares.first + r.shares.exposure + r.shares.rate == pytest.approx(1.0)


@pytest.mark.parametrize("attribution", ATTRIBUTIONS)
def test_parts_sum_to_gap_to_rounding(attribution):
    rng = np.random.default_rng(7)
    for _ in range(50):
        n = int(rng.integers(1, 30))
        occ = rng.uniform(0, 1, (n, 2))
        e = occ * rng.uniform(0, 20, (n, 2))
        post = e * rng.uniform(0, 1, (n, 2))
        r = decompose(estimates(occ, e, post, horizon=32), "A", "B", attribution)
        assert r.first + r.exposure + r.rate == pytest.approx(r.gap, rel=1e-12, abs=1e-15)


def test_undefined_rate_borrows_the_other_policy():
    est = estimates(occ=[[0.2, 0.5], [0.1, 0.4]], exp_=[[0, 3], [0, 2]], post=[[0, 1.0], [0, 0.5]])
    r = decompose(est, "A", "B")
    assert r.undefined_rate and np.isnan(r.rate_a)
    assert r.rate == 0.0
    assert r.exposure == pytest.approx((0 - 2.5) * 0.3 / 10)
    assert r.first + r.exposure + r.rate == pytest.approx(r.gap, abs=1e-15)
    both = decompose(estimates([[0.2, 0.1]], [[0, 0]], [[0, 0]]), "A", "B")
    assert (both.exposure, both.rate) == (0.0, 0.0) and both.gap == pytest.approx(0.01)


def test_refusals():
    est = estimates([[0.2, 0.1]], [[1, 1]], [[0.5, 0.5]])
    with pytest.raises(ValueError, match="policy 'C' is not in the data"):
        decompose(est, "A", "C")
    with pytest.raises(ValueError, match="unknown attribution"):
        decompose(est, "A", "B", "banzhaf")
    est["post_mismatch"][:] = np.nan
    with pytest.raises(ValueError, match="not identified"):
        decompose(est, "A", "B")


def test_pairing_uses_the_same_documents_for_both_policies():
    # B = A shifted by a constant per document: a paired bootstrap sees no variability
    # in the first-mismatch gap, an unpaired one would see the between-document spread.
    rng = np.random.default_rng(3)
    occ_a = rng.uniform(0.1, 0.7, 40)
    occ = np.stack([occ_a, occ_a + 0.2], axis=1)
    e = np.ones((40, 2))
    r = decompose(estimates(occ, e, 0.5 * e), "A", "B")
    ci = r.confidence_interval(n_resamples=999)
    assert ci.low.first == pytest.approx(-0.02) and ci.high.first == pytest.approx(-0.02)
    assert ci.low.gap == pytest.approx(-0.02) and ci.high.gap == pytest.approx(-0.02)


def test_traces_estimates_and_aggregate_agree_and_models_split():
    ds = simulate_study(8, {"A": PolicyEffect(0.03), "B": PolicyEffect(0.1)}, horizon=8, replicates=10,
                        seed=4, models=["m1", "m2"])
    est = divstats.estimate(ds)
    agg = divstats.aggregate(est)
    r_tr = decompose(ds, "A", "B")
    r_est = decompose(est, "A", "B")
    assert isinstance(r_tr.gap, xr.DataArray) and list(r_tr.gap["model"].values) == ["m1", "m2"]
    expected = agg["mismatch_fraction"].sel(policy="A") - agg["mismatch_fraction"].sel(policy="B")
    np.testing.assert_allclose(r_tr.gap.values, expected.transpose("model").values, rtol=1e-12)
    np.testing.assert_allclose(r_tr.gap.values, r_est.gap.values)
    np.testing.assert_allclose((r_tr.first + r_tr.exposure + r_tr.rate).values, r_tr.gap.values, rtol=1e-12)
    one = decompose(est.sel(model="m2"), "A", "B")
    assert float(r_tr.gap.sel(model="m2")) == pytest.approx(one.gap)
    ci = r_tr.confidence_interval(n_resamples=499)
    frame = ci.to_frame()
    assert set(frame["model"]) == {"m1", "m2"} and (frame.dropna()["low"] <= frame.dropna()["high"]).all()
    ds_out = r_tr.to_dataset()
    assert ds_out.attrs["a"] == "A" and "share_first" in ds_out


def test_bootstrap_intervals_cover_the_truth():
    cov = decomposition_coverage(n_docs=30, n_sims=40, n_resamples=499, seed=11)
    # Nominal 0.95; with 40 simulations anything below 0.85 would be a real failure.
    assert all(c >= 0.85 for c in cov.coverage.values()), cov.coverage
    assert cov.truth["gap"] == pytest.approx(cov.truth["first"] + cov.truth["exposure"] + cov.truth["rate"])
