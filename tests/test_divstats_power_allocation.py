"""divstats.design.allocation.allocate: target SE, Neyman budget, and the bias of pooling a data-dependent
allocation."""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr

import divstats
from divstats.design.allocation import allocate
from divstats.estimation.components import document_values
from divstats.truth.studies import PolicyEffect, markov_kernels, simulate_study

V, T = 4, 5


def test_target_se_and_budget():
    pilot = simulate_study(6, {"a": PolicyEffect(0.05), "b": PolicyEffect(0.15)}, horizon=8, replicates=6,
                           kind="residual", seed=5)
    vals = document_values(pilot).sel(metric="loss", drop=True)
    w = vals["mc_var"] * vals["replicates"]
    more = allocate(pilot, "loss", target_se=0.05, floor=0.0, min_replicates=0)
    total = more + 6
    # every cell reaches the target SE given its pilot variance (and not by more than one replicate)
    se = np.sqrt(w / total)
    assert float(se.max()) <= 0.05 + 1e-12
    assert bool(((total == 6) | (np.sqrt(w / np.maximum(total - 1, 1)) > 0.05)).all())
    spent = allocate(pilot, ["loss", "occurrence"], budget=500, min_replicates=0)
    assert 500 - spent.size <= int(spent.sum()) <= 500
    by_policy = allocate(pilot, "loss", budget=500, by="policy", min_replicates=0)
    assert (by_policy.std("doc") <= 1).all()   # one allocation per policy
    with pytest.raises(ValueError, match="exactly one"):
        allocate(pilot, "loss")


def _cells(n_docs: int):
    kernels, truth = [], []
    for d in range(n_docs):
        p, q = markov_kernels(500 + d, 0, PolicyEffect(0.06), V, 1.0)
        kernels.append((p, q))
        truth.append(divstats.exact(p, q, V, T).occurrence)
    return kernels, np.array(truth)


def _round(kernels, reps, seed):
    return [divstats.simulate(p, q, V, T, int(r), seed=seed * 1009 + i, doc=f"d{i}", policy="a")
            for i, ((p, q), r) in enumerate(zip(kernels, reps, strict=True))]


@pytest.mark.slow
def test_pooling_a_cell_wise_allocation_is_biased_and_later_rounds_alone_are_not():
    kernels, truth = _cells(6)
    r0 = 3
    pooled, later = [], []
    for s in range(80):
        pilot_parts = _round(kernels, [r0] * len(kernels), 2 * s)
        pilot = xr.concat(pilot_parts, dim="doc")
        more = allocate(pilot, "occurrence", target_se=0.08).values.ravel()
        m0 = divstats.estimate(pilot)["occurrence"].values.ravel()
        m1 = np.array([divstats.estimate(ds)["occurrence"].values.item() for ds in _round(kernels, more, 2 * s + 1)])
        pooled.append((r0 * m0 + more * m1) / (r0 + more))
        later.append(m1)
    pooled, later = np.array(pooled), np.array(later)

    def z(x):
        return (x.mean(0) - truth) / (x.std(0, ddof=1) / np.sqrt(x.shape[0]))

    assert np.abs(z(later)).max() < 4          # the rounds after the pilot are unbiased per cell
    assert np.abs(z(pooled)).max() > 4         # pooling with the pilot that chose the allocation is not
