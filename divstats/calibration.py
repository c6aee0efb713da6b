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
    n_docs: int
    n_sims: int
    level: float
    method: str
    coverage: dict[str, float]
    truth: dict[str, float]


def decomposition_coverage(*, n_docs: int = 30, n_sims: int = 100, level: float = 0.95,
                           method: str = "BCa", n_resamples: int = 999, horizon: int = 32,
                           seed: int = 0) -> DecompositionCoverage:
    """Coverage of the paired bootstrap intervals for gap, Δfirst, Δexposure, Δrate."""
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
