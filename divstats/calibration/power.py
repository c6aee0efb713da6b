"""Calibration of the power calculation: predicted power vs rejection rates on simulated studies.

:func:`power_calibration` checks ``divstats.design.power.power_at`` against the rate at
which ``paired_test`` rejects on studies drawn from a simulated pool whose documents *are*
the population (docs/design.md, "Predicted vs observed power").  Used by
tests/test_divstats_power.py (the slow test) and ``benchmarks/bench_power.py``; like every
module of this room, no production room imports it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr

from divstats.design.pilot import hypothesis_pilots
from divstats.design.power import power_at
from divstats.estimands import OCCURRENCE
from divstats.estimation.components import replicate_influence
from divstats.inference.paired import paired_pvalue
from divstats.truth.studies import PolicyEffect, simulate_study

__all__ = ["PowerDesign", "power_calibration"]


@dataclass(frozen=True)
class PowerDesign:
    """One design of :func:`power_calibration`: a test on ``n`` documents with ``R`` replicates."""

    test: str
    direction: str
    n: int
    R: int


def _calibration_plan(metric: str, designs: Sequence[PowerDesign], alpha: float) -> dict[str, Any]:
    keys = sorted({(d.test, d.direction) for d in designs})
    return {"plan": {"name": "power-calibration", "salt": "calibration", "alpha": alpha},
            "hypothesis": [{"id": f"{t}:{a}", "family": f"{t}:{a}", "metric": metric, "compare": ["a", "b"],
                            "test": t, "direction": a, "split": "all", "correction": "none"} for t, a in keys]}


def _observed_rejection(influence: xr.DataArray, design: PowerDesign, alpha: float, n_studies: int,
                        rng: np.random.Generator) -> float:
    """Rejection rate of ``paired_test`` on studies resampled from the pool (docs, then replicates)."""
    A = influence.sel(policy="a").values
    B = influence.sel(policy="b").values
    n_docs, n_rep = A.shape
    rejected = 0
    for _ in range(n_studies):
        docs = rng.integers(0, n_docs, design.n)[:, None]
        xa = A[docs, rng.integers(0, n_rep, (design.n, design.R))].mean(-1)
        xb = B[docs, rng.integers(0, n_rep, (design.n, design.R))].mean(-1)
        # the p-value alone: paired_test's effect intervals cost ~all of its time at large n
        rejected += paired_pvalue(xa, xb, design.test, design.direction, n_resamples=199) < alpha
    return rejected / n_studies


def power_calibration(designs: Sequence[PowerDesign], effects: tuple[float, float] = (0.05, 0.058), *,
                      metric: str = OCCURRENCE, kind: str = "residual", horizon: int = 8,
                      pool_docs: int = 40, pool_replicates: int = 64, alpha: float = 0.05,
                      n_studies: int = 1000, n_sims: int = 4000, seed: int = 0) -> pd.DataFrame:
    """Predicted power vs the rejection rate observed on simulated studies.

    A pool of ``pool_docs`` documents with ``pool_replicates`` replicates each is
    simulated with ``divstats.truth.studies.simulate_study`` (policies ``a`` and ``b``
    of the given strengths).  The pool *is* the population: a study draws its
    documents from the pool's and, for each, R of that document's replicates (both
    with replacement), and runs ``paired_test`` on the per-document estimates.  The
    prediction is :func:`power_at` with the pool as the pilot.

    Parameters
    ----------
    designs : sequence of PowerDesign
        The (test, direction, n, R) to check.
    effects : (float, float)
        Strengths (``PolicyEffect.eps``) of policies ``a`` and ``b``.
    metric, kind, horizon : str, str, int
        The metric tested and the traces simulated.
    pool_docs, pool_replicates : int
        Size of the pool (the population).
    alpha : float
        Level of every test.
    n_studies, n_sims, seed : int
        Simulated studies per design (observed), per prediction, and the seed.

    Returns
    -------
    pandas.DataFrame
        One row per design: test, direction, n, R, predicted, observed, difference and
        the observed rate's binomial SE.

    Examples
    --------
    >>> t = power_calibration([PowerDesign("ttest", "less", 6, 2)], pool_docs=6, pool_replicates=8,
    ...                       n_studies=20, n_sims=200)
    >>> list(t.columns[:3])
    ['kind', 'metric', 'effects']
    """
    pool = simulate_study(pool_docs, {"a": PolicyEffect(effects[0]), "b": PolicyEffect(effects[1])},
                          horizon=horizon, replicates=pool_replicates, kind=kind, seed=seed)
    pilots = {hp.hypothesis.id: hp for hp in hypothesis_pilots(_calibration_plan(metric, designs, alpha), pool)}
    influence = replicate_influence(pool)[metric]
    rng = np.random.default_rng(seed + 1)
    rows = []
    for i, d in enumerate(designs):
        predicted = power_at(pilots[f"{d.test}:{d.direction}"], d.n, d.R, n_sims=n_sims, seed=seed + i)
        observed = _observed_rejection(influence, d, alpha, n_studies, rng)
        rows.append({"kind": kind, "metric": metric, "effects": f"{effects[0]:g} vs {effects[1]:g}",
                     "test": d.test, "direction": d.direction, "n": d.n, "R": d.R, "predicted": predicted,
                     "observed": observed, "difference": predicted - observed,
                     "observed_se": math.sqrt(max(observed * (1 - observed), 1e-12) / n_studies)})
    return pd.DataFrame(rows)
