"""variance_components against exact enumeration: known between-document and Monte Carlo parts."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

import divstats
from divstats.estimation.components import document_values, replicate_influence, variance_components
from divstats.truth.studies import PolicyEffect, markov_kernels

V, T, R = 4, 5, 8
EFFECTS = {"a": PolicyEffect(0.08), "b": PolicyEffect(0.2)}


def _docs(n_docs: int, seed: int = 0):
    """Kernels per (doc, policy) and their exact occurrence."""
    rng = np.random.default_rng(seed)
    kernels, occ = [], np.zeros((n_docs, len(EFFECTS)))
    for d in range(n_docs):
        scale = float(np.exp(rng.normal(0.0, 0.5)))
        row = []
        for j, effect in enumerate(EFFECTS.values()):
            p, q = markov_kernels(1000 + d, j, effect, V, scale)
            row.append((p, q))
            occ[d, j] = divstats.exact(p, q, V, T).occurrence
        kernels.append(row)
    return kernels, occ


def _study(kernels, seed: int, common: bool = False, kind: str = "coupled") -> xr.Dataset:
    docs = []
    for d, row in enumerate(kernels):
        parts = [divstats.simulate(p, q, V, T, R, kind=kind, doc=f"d{d}", policy=pid,
                                   seed=seed * 7919 + d * (1 if common else 31) + (0 if common else j))
                 for j, ((p, q), pid) in enumerate(zip(row, EFFECTS, strict=True))]
        docs.append(xr.concat(parts, dim="policy"))
    return xr.concat(docs, dim="doc")


@pytest.fixture(scope="module")
def population():
    return _docs(24)


@pytest.fixture(scope="module")
def runs(population):
    kernels, _ = population
    return [variance_components(_study(kernels, s)) for s in range(10)]


def _z(values: np.ndarray, truth: float) -> float:
    return float((values.mean() - truth) / (values.std(ddof=1) / np.sqrt(values.size)))


def test_components_match_exact_occurrence(population, runs):
    """Coupled occurrence is Bernoulli(o_d): per-replicate variance o_d (1 - o_d), between var(o_d)."""
    _, occ = population
    for j, pid in enumerate(EFFECTS):
        per_rep = np.array([float(r["per_replicate"].sel(metric="occurrence", policy=pid)) for r in runs])
        total = np.array([float(r["total"].sel(metric="occurrence", policy=pid)) for r in runs])
        mc = np.array([float(r["monte_carlo"].sel(metric="occurrence", policy=pid)) for r in runs])
        assert abs(_z(per_rep, float(np.mean(occ[:, j] * (1 - occ[:, j]))))) < 4
        # E[total - mc] = var(o_d) exactly for fixed documents (the truncation at 0 aside)
        assert abs(_z(total - mc, float(np.var(occ[:, j], ddof=1)))) < 4
    diff = occ[:, 0] - occ[:, 1]
    d_per_rep = np.array([float(r["diff_per_replicate"].sel(metric="occurrence").squeeze("pair")) for r in runs])
    d_total = np.array([float(r["diff_total"].sel(metric="occurrence").squeeze("pair")) for r in runs])
    d_mc = np.array([float(r["diff_monte_carlo"].sel(metric="occurrence").squeeze("pair")) for r in runs])
    independent = float(np.mean(occ * (1 - occ), axis=0).sum())
    assert abs(_z(d_per_rep, independent)) < 4
    assert abs(_z(d_total - d_mc, float(np.var(diff, ddof=1)))) < 4


def test_components_fail_on_wrong_truth(population, runs):
    """The z-check above can fail: a 30% wrong Monte Carlo part is detected."""
    _, occ = population
    per_rep = np.array([float(r["per_replicate"].sel(metric="occurrence", policy="a")) for r in runs])
    assert abs(_z(per_rep, 1.3 * float(np.mean(occ[:, 0] * (1 - occ[:, 0]))))) > 4


def test_common_random_numbers_keep_estimates_unbiased_and_reduce_pair_variance(population):
    kernels, occ = population
    est, per_rep, corr = [], [], []
    for s in range(10):
        ds = _study(kernels, 100 + s, common=True)
        est.append(divstats.estimate(ds)["occurrence"].values)        # (doc, policy)
        vc = variance_components(ds)
        per_rep.append(float(vc["diff_per_replicate"].sel(metric="occurrence").squeeze("pair")))
        corr.append(float(vc["diff_mc_correlation"].sel(metric="occurrence").squeeze("pair")))
    est = np.array(est)
    # unbiased per document and policy: the mean over runs of the estimate vs the exact value
    se = est.std(axis=0, ddof=1) / np.sqrt(est.shape[0])
    z = (est.mean(axis=0) - occ) / np.where(se > 0, se, np.inf)
    assert np.abs(z).max() < 4.5
    assert abs(est.mean() - occ.mean()) < 4 * est.mean(axis=(1, 2)).std(ddof=1) / np.sqrt(est.shape[0])
    independent = float(np.mean(occ * (1 - occ), axis=0).sum())
    assert np.mean(per_rep) < 0.8 * independent
    assert np.mean(corr) > 0.2


def test_traces_and_estimates_agree_per_policy():
    from divstats.truth.studies import simulate_study

    ds = simulate_study(8, {"a": PolicyEffect(0.05), "b": PolicyEffect(0.15)}, horizon=8, replicates=6,
                        kind="residual", seed=3)
    from_traces = variance_components(ds)
    from_est = variance_components(divstats.estimate(ds))
    for name in ("mean", "total", "monte_carlo", "between", "per_replicate"):
        np.testing.assert_allclose(from_traces[name].values, from_est[name].values, rtol=1e-9, equal_nan=True)
    # estimates carry no replicate pairing: the pair's Monte Carlo covariance is taken as 0
    assert float(abs(from_est["diff_mc_correlation"]).max()) == 0.0
    infl = replicate_influence(ds)
    est = divstats.estimate(ds)
    for m in ("occurrence", "loss", "rate"):
        np.testing.assert_allclose(infl[m].mean("replicate").values, est[m].values, rtol=1e-9)
        se = infl[m].std("replicate", ddof=1) / np.sqrt(infl.sizes["replicate"])
        np.testing.assert_allclose(se.values, est[m + "_se"].values, rtol=1e-9)
    vals = document_values(ds)
    assert set(vals["value"].dims) == {"metric", "doc", "policy"}
    assert vc_describes(from_traces)


def vc_describes(vc: xr.Dataset) -> bool:
    return all(vc[v].attrs.get("description") for v in vc.data_vars) and "model" in vc.attrs


def test_window_on_estimates_is_refused():
    from divstats.truth.studies import simulate_study

    ds = simulate_study(2, {"a": PolicyEffect(0.05)}, horizon=4, replicates=3, seed=1)
    with pytest.raises(ValueError, match="window applies to traces"):
        variance_components(divstats.estimate(ds), window=2)
