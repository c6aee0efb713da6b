"""Every divstats estimator against exact enumeration (|z| < 4.5), and the identity.

For each kernel pair of divstats_cases we simulate coupled, residual (W = 0,
0 < W < T, W >= T) and reference traces with fixed seeds, estimate, and compare
each reported number with ``exact`` for the same window, using the reported SE.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np
import pytest
import xarray as xr
from divstats_cases import CASE_IDS, CASES, Case

import divstats as dv
from divstats.estimation.estimators import SCALARS

N = 3000
Z = 4.5
# Traces store TVs as float32, so estimates that are deterministic given the
# data (SE = 0) can differ from exact values by float32 rounding.
SLACK = 1e-6


def windows(case: Case) -> list[int]:
    return [0, 2, case.horizon]


@functools.cache
def traces(name: str, kind: str, window: int | None = None) -> xr.Dataset:
    case = CASES[CASE_IDS.index(name)]
    return dv.simulate(case.p, case.q, case.vocab_size, case.horizon, N, kind=kind, window=window,
                       seed=zlib.crc32(f"{name}/{kind}/{window}".encode()), eos=case.eos)


@functools.cache
def truth(name: str, window: int | None) -> dv.ExactResult:
    case = CASES[CASE_IDS.index(name)]
    return dv.exact(case.p, case.q, case.vocab_size, case.horizon, window, case.eos)


def assert_close(est, se, exact, what: str) -> None:
    est, se, exact = (np.asarray(a, dtype=float).ravel() for a in (est, se, exact))
    nan_exact = np.isnan(exact)
    assert np.array_equal(np.isnan(est), nan_exact), f"{what}: NaN pattern {est} vs exact {exact}"
    ok = ~nan_exact
    err = np.abs(est[ok] - exact[ok])
    bound = Z * np.nan_to_num(se[ok], nan=np.inf) + SLACK
    assert (err <= bound).all(), f"{what}: estimate {est} exact {exact} se {se}"


def check_estimate(est: xr.Dataset, ex: dv.ExactResult, what: str) -> None:
    for name in SCALARS:
        value = est[name].values
        if "not_identified" in est[name].attrs:
            assert np.isnan(value).all(), f"{what}: {name} not identified but reported"
            continue
        assert_close(value, est[name + "_se"].values, ex[name], f"{what} {name}")


def coupled_source(case: Case):
    return traces(case.name, "coupled")


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_coupled_estimates_match_exact_for_every_window(case: Case) -> None:
    ds = coupled_source(case)
    for w in windows(case):
        est = dv.estimate(ds, window=w)
        check_estimate(est, truth(case.name, min(w, case.horizon)), f"{case.name} coupled W={w}")


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_residual_estimates_match_exact_for_every_window(case: Case) -> None:
    for w in windows(case):
        est = dv.estimate(traces(case.name, "residual", w))
        assert est.attrs["window"] == min(w, case.horizon)
        check_estimate(est, truth(case.name, w), f"{case.name} residual W={w}")


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_reference_estimates_match_exact_with_window_zero(case: Case) -> None:
    est = dv.estimate(traces(case.name, "reference"))
    assert est.attrs["window"] == 0
    for name in ("post_mismatch", "rate", "loss", "mismatch_fraction", "exposure_contribution"):
        assert "not_identified" in est[name].attrs and np.isnan(est[name]).all()
    check_estimate(est, truth(case.name, 0), f"{case.name} reference")


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("kind", ["coupled", "residual", "reference"])
def test_survival_matches_exact(case: Case, kind: str) -> None:
    s = dv.survival(traces(case.name, kind, case.horizon if kind == "residual" else None))
    assert s.survival.dims == ("doc", "policy", "step")
    assert list(s.step.values) == list(range(case.horizon + 1))
    assert_close(s.survival.values, s.survival_se.values, truth(case.name, None).survival,
                 f"{case.name} {kind} survival")


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("kind", ["coupled", "residual"])
def test_branch_tv_matches_exact(case: Case, kind: str) -> None:
    ds = traces(case.name, kind, case.horizon if kind == "residual" else None)
    b = dv.branch_tv(ds)
    ex = truth(case.name, None).branch_tv
    # an age no replicate reached has no estimate even when its exact value exists
    seen = b.branch_tv_denominator.values.ravel() > 0
    assert_close(b.branch_tv.values.ravel()[seen], b.branch_tv_se.values.ravel()[seen], ex[seen],
                 f"{case.name} {kind} branch_tv")
    assert np.isnan(b.branch_tv.values.ravel()[~seen]).all()


@pytest.mark.parametrize("case", [c for c in CASES if c.name in ("markov3", "hashed4_eos", "early_eos")],
                         ids=lambda c: c.name)
@pytest.mark.parametrize("kind", ["coupled", "residual"])
def test_branch_tv_window_matches_exact_average(case: Case, kind: str) -> None:
    ds = traces(case.name, kind, case.horizon if kind == "residual" else None)
    ex = truth(case.name, None).branch_tv
    for start, stop in ((0, 2), (1, 3), (1, case.horizon - 1)):
        bw = dv.branch_tv_window(ds, start, stop)
        assert bw.branch_tv_window.dims == ("doc", "policy")
        assert_close(bw.branch_tv_window.values, bw.branch_tv_window_se.values,
                     np.nanmean(ex[start:stop]), f"{case.name} {kind} window [{start},{stop})")


def test_branch_tv_beyond_window_is_not_identified() -> None:
    ds = traces("markov3", "residual", 2)
    b = dv.branch_tv(ds)
    assert np.isnan(b.branch_tv.sel(age=3)).all() and "not_identified" in b.branch_tv.attrs
    bw = dv.branch_tv_window(ds, 1, 4)
    assert np.isnan(bw.branch_tv_window).all() and "not_identified" in bw.branch_tv_window.attrs
    ref = dv.branch_tv(traces("markov3", "reference"))
    assert np.isnan(ref.branch_tv).all() and "not_identified" in ref.branch_tv.attrs


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_sharp_interval_matches_exact_bounds(case: Case) -> None:
    sources = [("coupled", coupled_source(case), w) for w in windows(case)]
    sources += [("residual", traces(case.name, "residual", w), None) for w in windows(case)]
    for kind, ds, w in sources:
        si = dv.sharp_interval(ds, window=w)
        ex = truth(case.name, si.attrs["window"])
        T = case.horizon
        assert_close(si.loss_lower, si.loss_lower_se, ex.loss_lower, f"{case.name} {kind} lower")
        assert_close(si.loss_upper, si.loss_upper_se, ex.loss_upper, f"{case.name} {kind} upper")
        assert_close(si.mismatch_fraction_upper, si.mismatch_fraction_upper_se, ex.loss_upper / T, "mf")
        if ex.exposure > 0:
            assert_close(si.rate_lower, si.rate_lower_se, ex.window_mismatch / ex.exposure, "rate lo")
            assert_close(si.rate_upper, si.rate_upper_se,
                         (ex.window_mismatch + ex.tail_capacity) / ex.exposure, "rate hi")
        assert (si.loss_lower <= si.loss_upper + 1e-12).all()
        # the full loss lies in every window's interval
        assert ex.loss_lower - 1e-12 <= ex.loss <= ex.loss_upper + 1e-12


def test_interval_by_window_shrinks_to_the_loss() -> None:
    ds = coupled_source(CASES[0])
    T = CASES[0].horizon
    ib = dv.interval_by_window(ds, range(T + 1))
    assert ib.loss_lower.dims == ("window", "doc", "policy")
    lo, hi = ib.loss_lower.values.ravel(), ib.loss_upper.values.ravel()
    assert (np.diff(lo) >= -1e-12).all() and (np.diff(hi) <= 1e-12).all()
    full = dv.estimate(ds)
    assert lo[-1] == pytest.approx(full.loss.item()) and hi[-1] == pytest.approx(full.loss.item())


# --------------------------------------------------------------------------- identity

def assert_identity(est: xr.Dataset) -> None:
    T = est.attrs["horizon"]
    loss, occ, e, rate = (est[n].values for n in ("loss", "occurrence", "exposure", "rate"))
    ident = ~np.isnan(loss)
    pos = ident & (e > 0)
    np.testing.assert_allclose(loss[pos], occ[pos] + e[pos] * rate[pos], rtol=1e-13, atol=1e-15)
    zero = ident & (e == 0)
    assert np.isnan(rate[zero]).all()
    assert (est.exposure_contribution.values[zero] == 0).all() and (loss[zero] == occ[zero]).all()
    mf, first, ec = (est[n].values for n in ("mismatch_fraction", "first_mismatch_contribution",
                                             "exposure_contribution"))
    np.testing.assert_allclose(mf[ident], first[ident] + ec[ident], rtol=1e-13, atol=1e-16)
    np.testing.assert_allclose(mf[ident], loss[ident] / T, rtol=1e-13, atol=1e-16)
    np.testing.assert_allclose(first, occ / T, rtol=1e-15)
    np.testing.assert_allclose(est.loss_upper, est.loss_lower + est.tail_capacity, rtol=1e-15)


def multi_doc(kind: str) -> xr.Dataset:
    """Several docs and policies (different kernel pairs), all with horizon 4."""
    cases = [c for c in CASES if c.horizon == 4]
    parts = []
    for i, c in enumerate(cases):
        ds = dv.simulate(c.p, c.q, c.vocab_size, 4, 200, kind=kind, seed=i, eos=2, doc=f"d{i}",
                         policy="snapkv@0.5") if c.vocab_size == 3 else None
        parts.append(ds)
    docs = xr.concat([p for p in parts if p is not None], dim="doc")
    other = docs.assign_coords(policy=["recent@0.5"], press=("policy", ["recent"]))
    return xr.concat([docs, other], dim="policy")


@pytest.mark.parametrize("kind", ["coupled", "residual", "reference"])
def test_identity_per_doc_and_aggregated(kind: str) -> None:
    ds = multi_doc(kind)
    for w in ([None, 0, 2] if kind == "coupled" else [None]):
        est = dv.estimate(ds, window=w)
        assert est.occurrence.dims == ("doc", "policy")
        assert est.attrs["n_replicates"] == 200
        if kind != "reference" and w is None:
            assert_identity(est)
        agg = dv.aggregate(est)
        assert agg.occurrence.dims == ("policy",)
        if kind != "reference" and w is None:
            assert_identity(agg)
        for name in ("occurrence", "exposure", "post_mismatch", "rmtd", "loss_lower", "loss_upper"):
            np.testing.assert_allclose(agg[name], est[name].mean("doc"), rtol=1e-13)
            np.testing.assert_allclose(agg[name + "_se"], np.sqrt((est[name + "_se"] ** 2).sum("doc", skipna=False)) /
                                       est.sizes["doc"], rtol=1e-13)
            np.testing.assert_allclose(agg[name + "_sd_docs"], est[name].std("doc", ddof=1), rtol=1e-13)
        np.testing.assert_allclose(agg.rate, est.post_mismatch.sum("doc", skipna=False) / est.exposure.sum("doc"),
                                   rtol=1e-13)


def test_identity_on_exact_results() -> None:
    for c in CASES:
        for w in windows(c):
            ex = truth(c.name, w)
            if ex.exposure > 0:
                assert ex.loss == pytest.approx(ex.occurrence + ex.exposure * ex.rate, rel=1e-14)
            assert ex.mismatch_fraction == pytest.approx(
                ex.first_mismatch_contribution + ex.exposure_contribution, rel=1e-14, abs=1e-17)


def test_aggregate_rate_se_matches_pooled_delta_method() -> None:
    """With equal replicate counts the aggregate rate is a ratio of pooled means."""
    ds = multi_doc("residual").isel(policy=[0])
    est, agg = dv.estimate(ds), dv.aggregate(dv.estimate(ds))
    # Treat docs as strata: Var(mean_d P_d) etc. from per-doc MC variances; recompute by hand.
    n_d = est.sizes["doc"]
    vp = (est.post_mismatch_se ** 2).sum("doc") / n_d**2
    ve = (est.exposure_se ** 2).sum("doc") / n_d**2
    cv = est.post_mismatch_exposure_cov.sum("doc") / n_d**2
    r = agg.rate
    expected = np.sqrt(vp - 2 * r * cv + r**2 * ve) / est.exposure.mean("doc")
    np.testing.assert_allclose(agg.rate_se, expected, rtol=1e-12)


FILL = {"shared_tv": np.nan, "shared_token": -1, "branch_step": 0, "branch_tv": np.nan,
        "branch_x_token": -1, "branch_y_token": -1, "x_token": -1, "y_token": -1, "tv": np.nan,
        "x_logp": np.nan, "x_logq": np.nan}


@pytest.mark.parametrize("kind", ["coupled", "residual", "reference"])
def test_extra_model_dim_with_padded_replicates(kind: str) -> None:
    """Models combined with different replicate counts: padding must not count."""
    a = multi_doc(kind)
    b = multi_doc(kind).isel(replicate=slice(0, 120))
    both = xr.concat([a, b], dim=xr.DataArray(["m1", "m2"], dims="model"), join="outer",
                     fill_value={k: v for k, v in FILL.items() if k in a})
    both = both.transpose("doc", "model", "policy", "replicate", ...)   # model not in front
    est = dv.estimate(both)
    assert set(est.occurrence.dims) == {"model", "doc", "policy"}
    assert est.attrs["n_replicates"] == 200 and est.attrs["n_replicates_min"] == 120
    for m, src in (("m1", a), ("m2", b)):
        single = dv.estimate(src)
        for name in ("occurrence", "occurrence_se", "exposure", "rmtd", "loss_upper", "loss_upper_se",
                     "post_mismatch_exposure_cov"):
            xr.testing.assert_allclose(est[name].sel(model=m, drop=True).transpose("doc", "policy"),
                                       single[name])
        xr.testing.assert_allclose(dv.survival(both).survival.sel(model=m, drop=True)
                                   .transpose("doc", "policy", "step"), dv.survival(src).survival)
        if kind != "reference":
            bt = dv.branch_tv(both).sel(model=m, drop=True).transpose("doc", "policy", "age")
            xr.testing.assert_allclose(bt.branch_tv, dv.branch_tv(src).branch_tv)
            xr.testing.assert_allclose(
                dv.branch_tv_window(both, 1, 3).branch_tv_window_se.sel(model=m, drop=True)
                .transpose("doc", "policy"), dv.branch_tv_window(src, 1, 3).branch_tv_window_se)
            xr.testing.assert_allclose(dv.sharp_interval(both, window=1 if kind == "coupled" else None)
                                       .rate_upper_se.sel(model=m, drop=True).transpose("doc", "policy"),
                                       dv.sharp_interval(src, window=1 if kind == "coupled" else None)
                                       .rate_upper_se)
    if kind == "residual":
        vc = dv.variance_check(both)
        vb = dv.variance_check(b)
        for name in ("var_residual", "variance_reduction", "efficiency", "ess", "mcse"):
            xr.testing.assert_allclose(vc[name].sel(model="m2", drop=True).transpose("doc", "policy"),
                                       vb[name])
    agg = dv.aggregate(est)
    if kind == "reference":
        return
    assert set(agg.loss.dims) == {"model", "policy"}
    assert_identity(agg)
    assert set(dv.survival(both).survival.dims) == {"model", "doc", "policy", "step"}
    assert set(dv.branch_tv(both).branch_tv.dims) == {"model", "doc", "policy", "age"}
    assert set(dv.sharp_interval(both).loss_upper.dims) == {"model", "doc", "policy"}


# --------------------------------------------------------------------------- degenerate inputs

def test_no_divergence_anywhere() -> None:
    c = CASES[CASE_IDS.index("never_diverge")]
    for kind in ("coupled", "residual", "reference"):
        est = dv.estimate(traces(c.name, kind, c.horizon if kind == "residual" else None))
        assert est.occurrence.item() == 0 and est.exposure.item() == 0
        assert est.rmtd.item() == c.horizon and est.loss_upper.item() == 0
        if kind != "reference":
            assert est.loss.item() == 0 and np.isnan(est.rate.item())
            assert est.exposure_contribution.item() == 0 and est.mismatch_fraction.item() == 0
        agg = dv.aggregate(est)
        assert np.isnan(agg.rate.item()) and agg.occurrence.item() == 0


def test_one_replicate_gives_values_and_nan_se() -> None:
    c = CASES[0]
    for kind in ("coupled", "residual"):
        ds = dv.simulate(c.p, c.q, 3, 4, 1, kind=kind, seed=5)
        est = dv.estimate(ds)
        assert np.isfinite(est.occurrence).all() and np.isnan(est.occurrence_se).all()
        assert_identity(est)
        assert np.isnan(dv.survival(ds).survival_se.sel(step=2)).all()


def test_horizon_one() -> None:
    c = CASES[0]
    ex = dv.exact(c.p, c.q, 3, 1)
    assert ex.occurrence == pytest.approx(0.1) and ex.loss == pytest.approx(0.1)
    assert ex.exposure == 0 and np.isnan(ex.rate) and ex.exposure_contribution == 0
    for kind in ("coupled", "residual"):
        est = dv.estimate(dv.simulate(c.p, c.q, 3, 1, 500, kind=kind, seed=1))
        assert_close(est.loss, est.loss_se, 0.1, f"T=1 {kind}")
        assert est.attrs["post_identified"] == 1   # W >= T - 1 = 0 holds for any W


def test_window_at_least_horizon_equals_full() -> None:
    c = CASES[0]
    ds = dv.simulate(c.p, c.q, 3, 4, 300, kind="residual", window=10, seed=1)
    assert ds.attrs["window"] == 4
    full = dv.estimate(ds)
    xr.testing.assert_identical(full, dv.estimate(ds, window=10))
    np.testing.assert_allclose(full.loss_lower, full.loss)
    np.testing.assert_allclose(full.loss_upper, full.loss)
    # W = T - 1 already identifies the loss
    assert dv.estimate(ds, window=3).attrs["post_identified"] == 1


def test_clear_errors() -> None:
    c = CASES[0]
    res2 = traces("markov3", "residual", 2)
    with pytest.raises(ValueError, match="exceeds"):
        dv.estimate(res2, window=3)
    with pytest.raises(ValueError, match="window"):
        dv.estimate(coupled_source(c), window=-1)
    with pytest.raises(ValueError, match="kind"):
        dv.estimate(coupled_source(c).assign_attrs(kind="bogus"))
    with pytest.raises(ValueError, match="residual"):
        dv.variance_check(coupled_source(c))
    with pytest.raises(ValueError, match="W >= T - 1"):
        dv.variance_check(res2)
    with pytest.raises(ValueError, match="start"):
        dv.branch_tv_window(coupled_source(c), 3, 3)
    with pytest.raises(ValueError, match="kind"):
        dv.simulate(c.p, c.q, 3, 4, 10, kind="nope")
    with pytest.raises(ValueError, match="probability"):
        dv.exact(lambda h: np.array([0.5, 0.6, 0.0]), c.q, 3, 2)
    with pytest.raises(ValueError, match="shape"):
        dv.exact(lambda h: np.array([0.5, 0.5]), c.q, 3, 2)


@pytest.mark.parametrize("kind", ["coupled", "residual"])
def test_models_with_different_eos_use_their_own(kind: str) -> None:
    """protocols.combine across models keeps a per-model eos_token_id (global attr -1)."""
    from protocols import combine

    c = CASES[CASE_IDS.index("early_eos")]
    with_eos = dv.simulate(c.p, c.q, 3, 4, 400, kind=kind, window=1 if kind == "residual" else None,
                           seed=8, eos=2)
    no_eos = dv.simulate(c.p, c.q, 3, 4, 400, kind=kind, window=1 if kind == "residual" else None,
                         seed=9)
    both = combine([with_eos.assign_attrs(model="a"), no_eos.assign_attrs(model="b")], dim="model")
    assert both.attrs["eos_token_id"] == -1
    w = 1 if kind == "coupled" else None
    est = dv.estimate(both, window=w)
    for m, src in (("a", with_eos), ("b", no_eos)):
        single = dv.estimate(src, window=w)
        xr.testing.assert_allclose(est.tail_capacity.sel(model=m, drop=True), single.tail_capacity)
    ex = dv.exact(c.p, c.q, 3, 4, 1, eos=2)
    got = est.sel(model="a")
    assert_close(got.tail_capacity.values, got.tail_capacity_se.values, ex.tail_capacity, "eos tail")


# Fingerprints of simulate's integer draws (tokens, branch steps) recorded with the numpy
# inverse-CDF draw (np.cumsum + np.searchsorted side='right') before the draw moved to Python
# floats: the same seed must keep giving the same traces, or every fixed-seed test above
# silently tests other data.
_DRAWS = {("coupled", None, None): "be9ad535b2b4bc41", ("residual", 3, None): "ff570118dc758460",
          ("reference", None, None): "add99ab67913c004", ("coupled", None, 2): "5ac3ae04ac0f55d2"}


def _draw_fingerprint(ds: xr.Dataset) -> str:
    import hashlib

    h = hashlib.sha256()
    for name in sorted(n for n in ds.data_vars if ds[n].dtype.kind in "iu"):
        h.update(str(name).encode())
        h.update(np.ascontiguousarray(ds[name].values).tobytes())
    return h.hexdigest()[:16]


@pytest.mark.parametrize(("kind", "window", "eos"), list(_DRAWS))
def test_simulate_draws_are_those_of_the_numpy_inverse_cdf(kind, window, eos):
    p, q = dv.markov_kernels(7, 1, dv.PolicyEffect(0.3), 5, 1.0)
    ds = dv.simulate(p, q, 5, 6, 200, kind=kind, window=window, seed=11, eos=eos)
    assert _draw_fingerprint(ds) == _DRAWS[(kind, window, eos)]


@pytest.mark.parametrize(("kind", "window"), [("coupled", None), ("residual", 2), ("reference", None)])
def test_a_study_is_each_pairs_simulation_concatenated(kind, window):
    """simulate_study builds and validates one dataset from every (doc, policy)'s arrays: it must equal
    simulating each pair alone with the seeds the study draws, and concatenating (what it did before)."""
    effects = {"a": dv.PolicyEffect(0.1), "b": dv.PolicyEffect(0.3, 0.5)}
    got = dv.simulate_study(3, effects, horizon=5, replicates=4, kind=kind, window=window, vocab_size=4, seed=2)
    rng = np.random.default_rng(2)
    docs = []
    for d in range(3):
        scale = float(np.exp(rng.normal(0.0, 0.3)))
        docs.append(xr.concat([dv.simulate(*dv.markov_kernels(2 * 100_003 + d, j, e, 4, scale), 4, 5, 4, kind=kind,
                                           window=window, seed=int(rng.integers(2 ** 31)), doc=f"doc{d}", policy=pid)
                               for j, (pid, e) in enumerate(effects.items())], dim="policy"))
    want = xr.concat(docs, dim="doc")
    xr.testing.assert_identical(got, want)
    assert all(got[v].dtype == want[v].dtype for v in want.variables)
    with pytest.raises(ValueError, match="documents and policies"):
        dv.simulate_study(0, effects)


@pytest.mark.parametrize("kind", ["coupled", "residual"])
def test_by_window_is_each_windows_interval(kind):
    """interval_by_window builds one dataset from every window's numbers: each slice must be
    sharp_interval at that window (values, dims, coordinates), and no window is refused."""
    from divstats.estimation.interval import interval_by_window, sharp_interval
    from divstats.traces.arrays import without_attrs
    from divstats.truth.studies import PolicyEffect, simulate_study

    ds = simulate_study(3, {"a": PolicyEffect(0.2), "b": PolicyEffect(0.05)}, horizon=6, replicates=5, kind=kind,
                        window=4 if kind == "residual" else None, models=["m1", "m2"])
    by = interval_by_window(ds, [0, 2, 4])
    assert by["window"].values.tolist() == [0, 2, 4] and by.attrs == {"kind": kind, "horizon": 6}
    for w in (0, 2, 4):
        xr.testing.assert_identical(without_attrs(by.sel(window=w, drop=True)), without_attrs(sharp_interval(ds, w)))
    with pytest.raises(ValueError, match="at least one window"):
        interval_by_window(ds, [])
