"""Coverage of the reported 95% intervals (estimate +- 1.96 SE), measured by simulation.

One long simulation is split into independent groups of replicates (each group is
one repetition of the experiment, laid out as a document), so a single vectorised
``estimate`` gives the sampling distribution.  The default test is small; the slow
one uses more groups and more kernel pairs (docs/statistics.md quotes its numbers).
"""

from __future__ import annotations

import numpy as np
import pytest
from divstats_cases import CASE_IDS, CASES, split_replicates

import divstats as dv

QUANTITIES = ("occurrence", "rmtd", "exposure", "post_mismatch", "rate", "loss", "loss_lower",
              "loss_upper")


def coverage(name: str, kind: str, groups: int, per_group: int, window=None, seed=0) -> dict[str, float]:
    c = CASES[CASE_IDS.index(name)]
    ds = dv.simulate(c.p, c.q, c.vocab_size, c.horizon, groups * per_group, kind=kind, seed=seed,
                     eos=c.eos, window=window if kind == "residual" else None)
    est = dv.estimate(split_replicates(ds, groups), window=window if kind == "coupled" else None)
    ex = dv.exact(c.p, c.q, c.vocab_size, c.horizon, est.attrs["window"], c.eos)
    out = {}
    for q in QUANTITIES:
        v, se = est[q].values.ravel(), est[q + "_se"].values.ravel()
        if np.isnan(v).all():
            continue
        out[q] = float(np.mean(np.abs(v - ex[q]) <= 1.96 * se))
    return out


@pytest.mark.parametrize("kind", ["coupled", "residual"])
def test_coverage_small(kind: str) -> None:
    cov = coverage("markov3", kind, groups=100, per_group=100, seed=5)
    assert set(cov) >= {"occurrence", "loss", "rate"}
    for q, c in cov.items():
        assert 0.87 <= c <= 1.0, (q, c)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hashed4_eos", "early_eos"])
@pytest.mark.parametrize("kind,window", [("coupled", None), ("residual", None), ("coupled", 1),
                                         ("residual", 1)])
def test_coverage_many_groups(name: str, kind: str, window) -> None:
    cov = coverage(name, kind, groups=300, per_group=60, window=window, seed=9)
    for q, c in cov.items():
        # binomial(300, 0.95) has SD 1.3%; allow the small-sample delta-method rate some slack
        assert 0.90 <= c <= 0.99, (q, c)
