"""exact() against closed forms and an independent brute-force path enumeration;
the sharp-interval construction (extremal_kernels); the documented example numbers."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np
import pytest
from divstats_cases import CASE_IDS, CASES

import divstats as dv
from divstats.truth.kernels import CoupledKernels

DOCS = Path(__file__).resolve().parents[1] / "docs" / "statistics.md"


def iid(vec):
    v = np.asarray(vec, dtype=float)
    return lambda h: v


def test_history_independent_pair_closed_form() -> None:
    """With kernels that ignore the history every D_t ~ Bernoulli(delta) independently."""
    p, q, T, d = iid([0.5, 0.3, 0.2]), iid([0.4, 0.4, 0.2]), 5, 0.1
    ex = dv.exact(p, q, 3, T)
    t = np.arange(T + 1)
    np.testing.assert_allclose(ex.survival, (1 - d) ** t, rtol=1e-12)
    assert ex.occurrence == pytest.approx(1 - (1 - d) ** T)
    assert ex.loss == pytest.approx(T * d)
    assert ex.rate == pytest.approx(d)
    taus = np.arange(1, T + 1)
    assert ex.exposure == pytest.approx((d * (1 - d) ** (taus - 1) * (T - taus)).sum())
    assert ex.rmtd == pytest.approx(((1 - d) ** t[:T]).sum())
    np.testing.assert_allclose(ex.branch_tv, d, rtol=1e-12)
    for W in range(T + 1):
        exw = dv.exact(p, q, 3, T, W)
        # window mismatch: each observed post-divergence step disagrees w.p. d
        expect_win = sum(d * (1 - d) ** (s - 1) * d * min(W, T - s) for s in taus)
        assert exw.window_mismatch == pytest.approx(expect_win)
        assert exw.tail_capacity == pytest.approx(
            sum(d * (1 - d) ** (s - 1) * max(T - s - W, 0) for s in taus))


def brute_force(p, q, V: int, T: int, eos=None, W=None) -> dict[str, float]:
    """Enumerate every pair of full sequences with its coupling probability."""
    kern = CoupledKernels(p, q, V, eos)
    W = T if W is None else W
    acc = dict(occurrence=0.0, loss=0.0, exposure=0.0, post=0.0, rmtd=0.0, win=0.0, tail=0.0)
    for xs in itertools.product(range(V), repeat=T):
        for ys in itertools.product(range(V), repeat=T):
            prob = 1.0
            for s in range(T):
                law = kern.law(xs[:s], ys[:s])
                x, y = xs[s], ys[s]
                if x == y:
                    prob *= (1 - law.tv) * law.shared[x] if law.shared is not None else 0.0
                else:
                    prob *= law.tv * law.x_res[x] * law.y_res[y] if law.x_res is not None else 0.0
                if prob == 0.0:
                    break
            if prob == 0.0:
                continue
            D = np.array(xs) != np.array(ys)
            tau = int(np.argmax(D)) + 1 if D.any() else T + 1
            acc["occurrence"] += prob * D.any()
            acc["loss"] += prob * D.sum()
            acc["exposure"] += prob * max(T - tau, 0)
            acc["post"] += prob * D[tau:].sum()
            acc["rmtd"] += prob * min(tau, T)
            if tau <= T:
                K = min(W, T - tau)
                acc["win"] += prob * D[tau: tau + K].sum()
                ended = eos is not None and xs[tau + K - 1] == eos and ys[tau + K - 1] == eos
                acc["tail"] += prob * (T - tau - K) * (not ended)
    return acc


@pytest.mark.parametrize("name", ["markov3", "markov3_eos", "tv_one", "early_eos"])
def test_exact_matches_brute_force_enumeration(name: str) -> None:
    c = CASES[CASE_IDS.index(name)]
    T = 3
    for W in (0, 1, None):
        bf = brute_force(c.p, c.q, c.vocab_size, T, c.eos, W)
        ex = dv.exact(c.p, c.q, c.vocab_size, T, W, c.eos)
        assert ex.occurrence == pytest.approx(bf["occurrence"], abs=1e-12)
        assert ex.loss == pytest.approx(bf["loss"], abs=1e-12)
        assert ex.exposure == pytest.approx(bf["exposure"], abs=1e-12)
        assert ex.post_mismatch == pytest.approx(bf["post"], abs=1e-12)
        assert ex.rmtd == pytest.approx(bf["rmtd"], abs=1e-12)
        assert ex.window_mismatch == pytest.approx(bf["win"], abs=1e-12)
        assert ex.tail_capacity == pytest.approx(bf["tail"], abs=1e-12)


def test_exact_result_access() -> None:
    ex = dv.exact(CASES[0].p, CASES[0].q, 3, 4)
    assert ex["loss"] == ex.loss and set(ex.as_dict()) == set(dv.ExactResult.names())
    assert ex.survival.shape == (5,) and ex.branch_tv.shape == (4,)
    with pytest.raises(KeyError):
        ex["nope"]


def test_eos_is_absorbing_whatever_the_callable_says() -> None:
    # both kernels would leave EOS (token 2) if asked; exact must keep it absorbing
    p = lambda h: np.array([0.2, 0.2, 0.6]) if not h or h[-1] != 2 else np.array([1.0, 0.0, 0.0])  # noqa: E731
    q = lambda h: np.array([0.2, 0.2, 0.6]) if not h or h[-1] != 2 else np.array([0.0, 1.0, 0.0])  # noqa: E731
    ex = dv.exact(p, q, 3, 4, eos=2)
    assert ex.occurrence == 0.0 and ex.loss == 0.0
    ds = dv.simulate(p, q, 3, 4, 50, seed=0, eos=2)
    x = ds.x_token.values[0, 0]
    after = np.maximum.accumulate(x == 2, axis=-1)
    assert (x[after] == 2).all()


# --------------------------------------------------------------------------- construction

@pytest.mark.parametrize("name", ["markov3", "markov3_eos", "tv_one", "hashed4_eos", "early_eos",
                                  "never_diverge"])
def test_extremal_kernels_attain_the_interval(name: str) -> None:
    c = CASES[CASE_IDS.index(name)]
    T = min(c.horizon, 4)
    for W in range(0, T):
        orig = dv.exact(c.p, c.q, c.vocab_size, T, W, c.eos)
        for bound in ("lower", "upper"):
            p2, q2, V2, untag = dv.extremal_kernels(c.p, c.q, c.vocab_size, T, W, bound, c.eos)
            assert V2 == 4 * c.vocab_size + 3
            tagged = dv.exact(p2, q2, V2, T, W, c.eos)
            endpoint = orig.loss_lower if bound == "lower" else orig.loss_upper
            assert tagged.loss == pytest.approx(endpoint, abs=1e-12), (W, bound)
            # same observed window law: divergence time and window mismatches
            np.testing.assert_allclose(tagged.survival, orig.survival, atol=1e-12)
            assert tagged.occurrence == pytest.approx(orig.occurrence, abs=1e-12)
            assert tagged.exposure == pytest.approx(orig.exposure, abs=1e-12)
            assert tagged.window_mismatch == pytest.approx(orig.window_mismatch, abs=1e-12)
            np.testing.assert_allclose(tagged.branch_tv[: W + 1], orig.branch_tv[: W + 1], atol=1e-12)
            # and the tagged pair's own interval is the original one
            assert tagged.loss_lower == pytest.approx(orig.loss_lower, abs=1e-12)
            assert tagged.loss_upper == pytest.approx(orig.loss_upper, abs=1e-12)


def test_untag_preserves_mismatches() -> None:
    c = CASES[CASE_IDS.index("markov3_eos")]
    for bound in ("lower", "upper"):
        p2, q2, V2, untag = dv.extremal_kernels(c.p, c.q, 3, 4, 1, bound, c.eos)
        ds = dv.simulate(p2, q2, V2, 4, 300, seed=4, eos=c.eos)
        x, y = ds.x_token.values, ds.y_token.values
        assert untag(x).max() < 3 and untag(y).max() < 3
        np.testing.assert_array_equal(untag(x) != untag(y), x != y)


# --------------------------------------------------------------------------- documented numbers

def documented(label: str) -> dict[str, float]:
    """Numbers from the `<!-- check:label -->` table in docs/statistics.md."""
    text = DOCS.read_text()
    block = text.split(f"<!-- check:{label} -->", 1)[1].split("<!-- /check -->", 1)[0]
    return {m[1]: float(m[2]) for m in re.finditer(r"^\|\s*`(\w+)`\s*\|\s*([-0-9.eE+]+)\s*\|", block, re.M)}


def test_documented_worked_example_numbers() -> None:
    p, q = iid([0.5, 0.3, 0.2]), iid([0.4, 0.4, 0.2])
    ex = dv.exact(p, q, 3, 3, window=1)
    nums = documented("iid")
    assert len(nums) >= 10
    for name, value in nums.items():
        assert ex[name] == pytest.approx(value, abs=5e-7), name


def test_documented_history_dependent_example_numbers() -> None:
    c = CASES[CASE_IDS.index("markov3_eos")]
    ex = dv.exact(c.p, c.q, 3, 4, window=1, eos=2)
    nums = documented("markov")
    assert len(nums) >= 10
    for name, value in nums.items():
        assert ex[name] == pytest.approx(value, abs=5e-7), name


# --------------------------------------------------------------------------- random kernel pairs

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def random_kernel(seed: int, V: int, conc: float, point_mass: bool):
    def k(h):
        rng = np.random.default_rng([seed, len(h), *h])
        v = rng.dirichlet(np.full(V, conc))
        if point_mass and rng.random() < 0.3:   # some exact point masses (TV = 0 or 1 steps)
            v = np.eye(V)[rng.integers(V)]
        return v
    return k


@settings(max_examples=12, deadline=None)
@given(seed_p=st.integers(0, 10_000), seed_q=st.integers(0, 10_000), V=st.integers(2, 3),
       conc=st.sampled_from([0.3, 1.0, 5.0]), point_mass=st.booleans(),
       eos=st.sampled_from([None, 1]), W=st.integers(0, 3))
def test_random_pairs_exact_brute_force_and_construction(seed_p, seed_q, V, conc, point_mass, eos, W):
    T = 3
    p, q = random_kernel(seed_p, V, conc, point_mass), random_kernel(seed_q, V, conc, point_mass)
    ex = dv.exact(p, q, V, T, W, eos)
    bf = brute_force(p, q, V, T, eos, W)
    assert ex.loss == pytest.approx(bf["loss"], abs=1e-12)
    assert ex.window_mismatch == pytest.approx(bf["win"], abs=1e-12)
    assert ex.tail_capacity == pytest.approx(bf["tail"], abs=1e-12)
    assert ex.loss_lower - 1e-12 <= ex.loss <= ex.loss_upper + 1e-12
    if ex.exposure > 0:
        assert ex.loss == pytest.approx(ex.occurrence + ex.exposure * ex.rate, rel=1e-14)
    for bound in ("lower", "upper"):
        p2, q2, V2, _ = dv.extremal_kernels(p, q, V, T, W, bound, eos)
        tagged = dv.exact(p2, q2, V2, T, W, eos)
        assert tagged.loss == pytest.approx(ex["loss_" + bound], abs=1e-12)
        assert tagged.window_mismatch == pytest.approx(ex.window_mismatch, abs=1e-12)
        assert tagged.occurrence == pytest.approx(ex.occurrence, abs=1e-12)
