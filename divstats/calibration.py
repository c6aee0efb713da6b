"""Calibration studies for the inference layer: simulated studies with known truth.

Two kinds of experiment, shared by the tests (small, seconds) and
``benchmarks/bench_calibration.py`` (larger, printing a table):

* :func:`paired_calibration` — type-I error and power of the paired tests, and
  coverage of their effect-size intervals, on per-document differences drawn
  from a symmetric heavy-tailed law around a known shift;
* :func:`decomposition_coverage` — coverage of the paired BCa bootstrap intervals
  of the gap decomposition, documents drawn from a population whose aggregate
  gap and parts are known (computed from a very large draw).

:func:`simulate_study` builds a multi-document, multi-policy trace dataset from
tabular Markov kernels with planted policy effects, for end-to-end checks of
``run_plan`` and ``analyze``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import xarray as xr

from divstats.decompose import bootstrap_gap, split_gap
from divstats.paired import paired_test

__all__ = [
    "DecompositionCoverage", "PairedCalibration", "PolicyEffect", "decomposition_coverage", "markov_kernels",
    "paired_calibration", "simulate_study"
]

# ---------------------------------------------------------------------------
# Simulated studies (trace datasets)
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class PolicyEffect:
    """Eviction strength of a simulated policy.

    The candidate law is q_t = (1 − ε_t) p_t + ε_t n_t with ε_t = min(1, eps · (1 + growth · t)),
    t the history length: ``eps`` moves divergence earlier, ``growth`` makes the
    branches' laws drift further apart with age (late TV > early TV).
    """

    eps: float
    growth: float = 0.0


def markov_kernels(doc_seed: int, policy_seed: int, effect: PolicyEffect, vocab_size: int = 6,
                   doc_scale: float = 1.0, row_mix: float = 0.15):
    """(p, q) callables history → probabilities: a per-document Markov chain and its perturbation.

    The chain's rows share a common base law (weight 1 − ``row_mix``), so two
    branches that differ only in their last token have close next-token laws and
    the branch-aligned TV is driven by the policy's ε_t rather than by the chain.

    Parameters
    ----------
    doc_seed, policy_seed : int
        Seeds of the document's chain and of the policy's perturbation.
    effect : PolicyEffect
        The policy's strength.
    vocab_size : int
        V.
    doc_scale : float
        The document's strength multiplier.
    row_mix : float
        Weight of the row-specific part of each transition row.

    Returns
    -------
    (callable, callable)
        p and q: a history (tuple of tokens) → probabilities.

    Examples
    --------
    >>> p, q = markov_kernels(0, 0, PolicyEffect(0.1))
    >>> round(float(p((1,)).sum()), 12), round(float(q((1,)).sum()), 12)
    (1.0, 1.0)
    """
    rng = np.random.default_rng([doc_seed, 17])
    base = rng.dirichlet(np.full(vocab_size, 1.0))
    trans = (1 - row_mix) * base + row_mix * rng.dirichlet(np.full(vocab_size, 0.6), size=vocab_size)
    # A distinct non-zero entropy word per policy (SeedSequence ignores trailing zeros).
    noise = np.random.default_rng([doc_seed, policy_seed + 1, 29]).dirichlet(np.full(vocab_size, 0.6),
                                                                             size=vocab_size)

    def p(history: tuple[int, ...]) -> np.ndarray:
        return trans[history[-1] if history else 0]

    def q(history: tuple[int, ...]) -> np.ndarray:
        eps = min(1.0, effect.eps * doc_scale * (1.0 + effect.growth * len(history)))
        last = history[-1] if history else 0
        return (1.0 - eps) * trans[last] + eps * noise[last]

    return p, q


def simulate_study(n_docs: int, policies: Mapping[str, PolicyEffect], *, horizon: int = 10,
                   replicates: int = 20, kind: str = "coupled", window: int | None = None,
                   vocab_size: int = 6, seed: int = 0, doc_prefix: str = "doc",
                   models: Sequence[str] | None = None, doc_sd: float = 0.3) -> xr.Dataset:
    """A trace dataset over (doc, policy[, model]) simulated with ``divstats.simulate``.

    Each document has its own chain and a random strength multiplier exp(N(0, doc_sd))
    shared by its policies (so paired comparisons see correlated documents).

    Parameters
    ----------
    n_docs : int
        Documents.
    policies : mapping of str to PolicyEffect
        Policy id → its simulated strength.
    horizon, replicates : int
        T and replicates per (doc, policy).
    kind : {"coupled", "residual", "reference"}
        Trace kind.
    window : int, optional
        W for residual traces.
    vocab_size : int
        V.
    seed : int
        Seed of the whole study.
    doc_prefix : str
        Document ids are ``doc_prefix + index``.
    models : sequence of str, optional
        Simulate each model separately and stack along a ``model`` dim.
    doc_sd : float
        SD of the log strength multiplier across documents.

    Returns
    -------
    xarray.Dataset
        A trace dataset over (doc, policy[, model], replicate, step).

    Examples
    --------
    >>> ds = simulate_study(3, {"a": PolicyEffect(0.1), "b": PolicyEffect(0.2)}, horizon=4, replicates=2)
    >>> dict(ds.sizes)["doc"], ds["policy"].values.tolist()
    (3, ['a', 'b'])
    """
    from divstats import simulate

    if models:
        parts = [simulate_study(n_docs, policies, horizon=horizon, replicates=replicates, kind=kind,
                                window=window, vocab_size=vocab_size, seed=seed + 1000 * (i + 1),
                                doc_prefix=doc_prefix, doc_sd=doc_sd) for i, _ in enumerate(models)]
        out = xr.concat(parts, dim=xr.DataArray(list(models), dims="model", name="model"))
        out.attrs["model"] = ",".join(models)
        return out
    rng = np.random.default_rng(seed)
    docs = []
    for d in range(n_docs):
        scale = float(np.exp(rng.normal(0.0, doc_sd)))
        per_policy = []
        for j, (pid, effect) in enumerate(policies.items()):
            p, q = markov_kernels(seed * 100_003 + d, j, effect, vocab_size, scale)
            per_policy.append(simulate(p, q, vocab_size, horizon, replicates, kind=kind, window=window,
                                       seed=int(rng.integers(2 ** 31)), doc=f"{doc_prefix}{d}", policy=pid))
        docs.append(xr.concat(per_policy, dim="policy"))
    return xr.concat(docs, dim="doc")


# ---------------------------------------------------------------------------
# Paired tests: size, power, interval coverage
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class PairedCalibration:
    """Outcome of :func:`paired_calibration`: rejection rate and interval coverages at one setting."""

    test: str
    alternative: str
    n_docs: int
    n_sims: int
    shift: float
    rejection_rate: float
    effect_coverage: float
    mean_ci_coverage: float
    hl_ci_coverage: float


def paired_calibration(test: str = "wilcoxon", *, n_docs: int = 20, n_sims: int = 400, shift: float = 0.0,
                       alpha: float = 0.05, alternative: str = "two-sided", seed: int = 0,
                       n_resamples: int = 999, mean_ci: str = "t") -> PairedCalibration:
    """Rejection rate and interval coverage for per-document differences shift + 0.1·t₅.

    The law is symmetric, so mean, median and Hodges–Lehmann location all equal
    ``shift``: every interval is checked against the same truth.

    Parameters
    ----------
    test : str
        The paired test (``divstats.paired.TESTS``).
    n_docs, n_sims : int
        Documents per simulated study and studies.
    shift : float
        The true location of the differences (0: the null).
    alpha : float
        Level of the test; intervals are at 1 − alpha.
    alternative : str
        H1 about A − B.
    seed : int
        Seed of the simulation.
    n_resamples : int
        Resamples of each test.
    mean_ci : {"t", "bootstrap"}
        Interval for the mean difference.

    Returns
    -------
    PairedCalibration
        Rejection rate and the three coverages.

    Examples
    --------
    >>> r = paired_calibration("ttest", n_docs=10, n_sims=20)
    >>> 0 <= r.rejection_rate <= 1
    True
    """
    rng = np.random.default_rng(seed)
    rej = cov = cov_m = cov_hl = 0
    for i in range(n_sims):
        a = rng.normal(0.5, 0.2, n_docs)  # the per-document level cancels in the pair
        d = shift + 0.1 * rng.standard_t(5, n_docs)
        res = paired_test(a + d, a, test, alternative, confidence_level=1 - alpha,
                          n_resamples=n_resamples, seed=i, mean_ci=mean_ci)
        rej += res.pvalue < alpha
        cov += res.ci_low <= shift <= res.ci_high
        cov_m += res.mean_ci_low <= shift <= res.mean_ci_high
        cov_hl += res.hl_ci_low <= shift <= res.hl_ci_high
    return PairedCalibration(test, alternative, n_docs, n_sims, shift, float(rej / n_sims),
                             float(cov / n_sims), float(cov_m / n_sims), float(cov_hl / n_sims))


# ---------------------------------------------------------------------------
# Decomposition bootstrap coverage
# ---------------------------------------------------------------------------

def _population(n: int, rng: np.random.Generator, horizon: int) -> tuple[np.ndarray, ...]:
    """Per-document (o_A, o_B, e_A, e_B, post_A, post_B) with A, B correlated through the document."""
    base = rng.beta(2.0, 3.0, n)
    o_a = np.clip(base + rng.normal(0, 0.05, n), 0, 1)
    o_b = np.clip(base * 1.3 + rng.normal(0, 0.05, n), 0, 1)
    frac = rng.uniform(0.3, 0.7, n)                  # how early divergence happens
    e_a = o_a * horizon * frac
    e_b = o_b * horizon * np.clip(frac + 0.1, 0, 1)
    r = rng.beta(2.0, 6.0, n)
    return o_a, o_b, e_a, e_b, e_a * r, e_b * np.clip(r * 1.2, 0, 1)


@dataclass(frozen=True)
class DecompositionCoverage:
    """Outcome of :func:`decomposition_coverage`: coverage per part and the true values."""

    n_docs: int
    n_sims: int
    level: float
    method: str
    coverage: dict[str, float]
    truth: dict[str, float]


def decomposition_coverage(*, n_docs: int = 30, n_sims: int = 100, level: float = 0.95,
                           method: str = "BCa", n_resamples: int = 999, horizon: int = 32,
                           seed: int = 0) -> DecompositionCoverage:
    """Coverage of the paired bootstrap intervals for gap, Δfirst, Δexposure, Δrate.

    Parameters
    ----------
    n_docs, n_sims : int
        Documents per simulated study and studies.
    level : float
        Interval level.
    method : str
        scipy bootstrap method.
    n_resamples : int
        Resamples per interval.
    horizon : int
        T.
    seed : int
        Seed of the simulation.

    Returns
    -------
    DecompositionCoverage
        Coverage and true value of gap, first, exposure and rate.

    Examples
    --------
    >>> r = decomposition_coverage(n_docs=10, n_sims=2, n_resamples=99, method="percentile")
    >>> sorted(r.coverage)
    ['exposure', 'first', 'gap', 'rate']
    """
    rng = np.random.default_rng(seed)
    truth_draw = _population(2_000_000, np.random.default_rng(seed + 1), horizon)
    truth = split_gap(*truth_draw, horizon, "shapley")[:4]
    names = ("gap", "first", "exposure", "rate")
    hits = np.zeros(4)
    for i in range(n_sims):
        sample = _population(n_docs, rng, horizon)
        lo, hi = bootstrap_gap(sample, horizon, "shapley", level, method, n_resamples, seed + i)
        hits += (lo <= truth) & (truth <= hi)
    return DecompositionCoverage(n_docs, n_sims, level, method,
                                 {k: float(h / n_sims) for k, h in zip(names, hits, strict=True)},
                                 {k: float(t) for k, t in zip(names, truth, strict=True)})
