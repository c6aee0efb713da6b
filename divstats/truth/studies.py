"""Simulated studies with planted policy effects: trace datasets whose truth is known.

:func:`simulate_study` builds a multi-document, multi-policy trace dataset from
tabular Markov kernels (:func:`markov_kernels`) with planted policy effects
(:class:`PolicyEffect`), for end-to-end checks of ``run_plan`` and ``analyze``, the
docstring examples and the power calibration (``divstats.design.power``). It lives
with the simulator in ``truth/`` because production code (the design room) uses it;
the coverage studies that use it are ``divstats.calibration``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import xarray as xr

from divstats.truth.simulate import simulate_grid

__all__ = ["PolicyEffect", "markov_kernels", "simulate_study"]



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

    Raises
    ------
    ValueError
        For no documents or no policies, or sizes :func:`divstats.simulate` refuses.

    Examples
    --------
    >>> ds = simulate_study(3, {"a": PolicyEffect(0.1), "b": PolicyEffect(0.2)}, horizon=4, replicates=2)
    >>> dict(ds.sizes)["doc"], ds["policy"].values.tolist()
    (3, ['a', 'b'])
    """
    if models:
        parts = [simulate_study(n_docs, policies, horizon=horizon, replicates=replicates, kind=kind,
                                window=window, vocab_size=vocab_size, seed=seed + 1000 * (i + 1),
                                doc_prefix=doc_prefix, doc_sd=doc_sd) for i, _ in enumerate(models)]
        out = xr.concat(parts, dim=xr.DataArray(list(models), dims="model", name="model"))
        out.attrs["model"] = ",".join(models)
        return out
    if n_docs < 1 or not policies:
        raise ValueError(f"a study needs documents and policies, got {n_docs} documents and {len(policies)} policies")
    rng = np.random.default_rng(seed)
    kernels, seeds = [], []
    for d in range(n_docs):
        scale = float(np.exp(rng.normal(0.0, doc_sd)))
        kernels.append([markov_kernels(seed * 100_003 + d, j, effect, vocab_size, scale)
                        for j, effect in enumerate(policies.values())])
        seeds.append([int(rng.integers(2 ** 31)) for _ in policies])
    return simulate_grid(kernels, seeds, vocab_size, horizon, replicates, kind=kind, window=window,
                         docs=[f"{doc_prefix}{d}" for d in range(n_docs)], policies=list(policies))
