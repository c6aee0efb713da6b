"""Variance dominance of the residual-branch estimator (docs/statistics.md §5), checked against an
independent crude (coupled) simulation of the same kernel pair."""

from __future__ import annotations

import numpy as np
import pytest
from divstats_cases import CASE_IDS, CASES

import divstats as dv

N = 4000


def crude_variance(c, seed: int) -> tuple[float, float]:
    """Empirical variance of the crude total loss L and its standard error."""
    ds = dv.simulate(c.p, c.q, c.vocab_size, c.horizon, N, kind="coupled", seed=seed, eos=c.eos)
    L = (ds.x_token != ds.y_token).sum("step").values.ravel().astype(float)
    v = L.var(ddof=1)
    m4 = ((L - L.mean()) ** 4).mean()
    return v, float(np.sqrt((m4 - v**2) / len(L)))


@pytest.mark.parametrize("name", ["markov3", "hashed4_eos", "early_eos", "near_point_mass", "tv_one"])
def test_residual_variance_below_crude(name: str) -> None:
    c = CASES[CASE_IDS.index(name)]
    res = dv.simulate(c.p, c.q, c.vocab_size, c.horizon, N, kind="residual", seed=21, eos=c.eos)
    vc = dv.variance_check(res)
    get = lambda k: vc[k].item()  # noqa: E731
    crude, crude_se = crude_variance(c, seed=22)
    # the implied crude variance (residual variance + estimated reduction) is the crude variance
    assert abs(get("var_crude_implied") - crude) <= 4.5 * np.sqrt(2) * crude_se
    # and the residual estimator's variance is below it beyond Monte Carlo noise
    assert get("var_residual") < crude - 4.5 * crude_se
    assert 0 < get("variance_ratio") < 1
    assert get("variance_reduction") > 0
    T = c.horizon
    assert T < get("steps_residual") <= 2 * T and get("steps_crude") == T
    assert get("efficiency") == pytest.approx(
        get("var_crude_implied") * T / (get("var_residual") * get("steps_residual")))
    # arviz diagnostics: independent replicates give ESS near n, MCSE near the reported SE
    assert 0.8 * N < get("ess") < 1.2 * N
    assert get("mcse") == pytest.approx(dv.estimate(res).loss_se.item(), rel=0.15)


def test_variance_check_dims_follow_the_data() -> None:
    c = CASES[0]
    res = dv.simulate(c.p, c.q, 3, 4, 200, kind="residual", seed=3)
    vc = dv.variance_check(res)
    assert vc.variance_ratio.dims == ("doc", "policy")
    assert "description" in vc.efficiency.attrs
