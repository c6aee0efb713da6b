"""Simulated answer scores with a known paired difference (docs/statistics.md §12).

:func:`simulate_answer_scores` draws (document x replicate) scores of P and Q whose
population accuracies and paired difference are known, for the coverage study of
``divstats.compare_answers`` (benchmarks/bench_answers_coverage.py) and the tests;
:func:`with_answer_scores` puts such scores on a simulated trace dataset (the variables
of traces with task outcomes: ``x_score``, ``y_score``, ``needle_depth``,
``x_answer_start``, ``x_text``, ``y_text``), so that ``analyze`` and the report can be
exercised without a model.

The model: document d has P's probability of a right answer p_d ~ Beta(a, b) with mean
``x_accuracy`` and concentration a + b = ``concentration`` (documents differ: that is
what dominates a pass-key task); each replicate's P answer is right with probability p_d;
Q loses a right answer with probability ``lost`` and finds a wrong one's answer with
probability ``gained``, so the pairs are coupled (Q copies P otherwise).  The population
paired difference is E[Y − X] = −lost · x_accuracy + gained · (1 − x_accuracy).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import xarray as xr

__all__ = ["simulate_answer_scores", "true_difference", "with_answer_scores"]


def true_difference(x_accuracy: float, lost: float, gained: float) -> float:
    """The population paired difference E[Y − X] of :func:`simulate_answer_scores`.

    Parameters
    ----------
    x_accuracy, lost, gained : float
        As for :func:`simulate_answer_scores`.

    Returns
    -------
    float

    Examples
    --------
    >>> true_difference(0.5, 0.2, 0.1)
    -0.05
    """
    return -lost * x_accuracy + gained * (1.0 - x_accuracy)


def simulate_answer_scores(n_docs: int, replicates: int = 1, *, x_accuracy: float = 0.6, lost: float = 0.3,
                           gained: float = 0.05, concentration: float = 2.0,
                           rng: np.random.Generator | int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(document x replicate) 0/1 scores of P and Q, coupled, with a known difference.

    Parameters
    ----------
    n_docs, replicates : int
        The shape.
    x_accuracy : float
        P's population accuracy (the mean of p_d).
    lost, gained : float
        Probability that Q is wrong where P is right, and right where P is wrong.
    concentration : float
        a + b of the Beta law of p_d (small: documents differ a lot; inf: all equal).
    rng : numpy.random.Generator or int
        Randomness (a seed makes one).

    Returns
    -------
    (numpy.ndarray, numpy.ndarray)
        P's and Q's scores.

    Examples
    --------
    >>> x, y = simulate_answer_scores(4000, 2, x_accuracy=0.5, lost=0.2, gained=0.1)
    >>> round(float((y - x).mean()), 2)
    -0.05
    """
    rng = np.random.default_rng(rng)
    if np.isinf(concentration):
        p = np.full(n_docs, x_accuracy)
    else:
        p = rng.beta(x_accuracy * concentration, (1 - x_accuracy) * concentration, size=n_docs)
    x = (rng.random((n_docs, replicates)) < p[:, None]).astype(float)
    flip = rng.random((n_docs, replicates))
    y = np.where(x == 1, (flip >= lost).astype(float), (flip < gained).astype(float))
    return x, y


def with_answer_scores(ds: xr.Dataset, effects: Mapping[str, tuple[float, float]], *, x_accuracy: float = 0.7,
                       concentration: float = 2.0, seed: int = 0) -> xr.Dataset:
    """A coupled trace dataset with simulated answers: scores, texts, needle depths, answer starts.

    Each policy's (lost, gained) is in ``effects`` (a policy not named copies P).  Needles
    lie at evenly spread depths; a policy loses answers more often the earlier its needle
    (lost · 2 (1 − depth), capped at 1), as a recency policy would.  Where P and Q did not
    diverge within the trace Q's answer is P's.  P's answer starts at token T // 2.

    Parameters
    ----------
    ds : xarray.Dataset
        Coupled traces over (doc, policy, replicate, step).
    effects : mapping of str to (float, float)
        Policy → (lost, gained).
    x_accuracy, concentration : float
        As for :func:`simulate_answer_scores`.
    seed : int
        Randomness.

    Returns
    -------
    xarray.Dataset
        ``ds`` with ``x_score``, ``y_score``, ``x_text``, ``y_text``, ``x_answer_start``
        (doc, policy, replicate) and ``needle_depth``, ``answers``, ``scorer``, ``task`` (doc).

    Examples
    --------
    >>> from divstats.truth.studies import PolicyEffect, simulate_study
    >>> ds = simulate_study(6, {"a": PolicyEffect(0.2)}, horizon=6, replicates=2)
    >>> sorted(v for v in with_answer_scores(ds, {"a": (0.5, 0.0)}).data_vars if v.endswith("_score"))
    ['x_score', 'y_score']
    """
    rng = np.random.default_rng(seed)
    n_docs, n_pol, n_rep = (ds.sizes[d] for d in ("doc", "policy", "replicate"))
    depth = (np.arange(n_docs) + 0.5) / n_docs
    p = rng.beta(x_accuracy * concentration, (1 - x_accuracy) * concentration, size=n_docs)
    x = (rng.random((n_docs, n_pol, n_rep)) < p[:, None, None]).astype(float)
    y = x.copy()
    tau_none = np.asarray((ds["x_token"] == ds["y_token"]).all("step").transpose("doc", "policy", "replicate"))
    for j, pol in enumerate(str(q) for q in ds["policy"].values):
        lost, gained = effects.get(pol, (0.0, 0.0))
        lost_d = np.minimum(1.0, lost * 2 * (1 - depth))[:, None]
        u = rng.random((n_docs, n_rep))
        y[:, j] = np.where(x[:, j] == 1, (u >= lost_d).astype(float), (u < gained).astype(float))
    y = np.where(tau_none, x, y)
    keys = [f"{k:05d}" for k in rng.integers(0, 100000, size=n_docs)]
    x_text = np.array([[[keys[d] if x[d, j, r] else "unknown" for r in range(n_rep)] for j in range(n_pol)]
                       for d in range(n_docs)])
    y_text = np.array([[[keys[d] if y[d, j, r] else ("unknown" if x[d, j, r] == y[d, j, r] else "00000")
                         for r in range(n_rep)] for j in range(n_pol)] for d in range(n_docs)])
    dims = ("doc", "policy", "replicate")
    start = np.full(x.shape, int(ds.sizes["step"]) // 2, dtype=np.int32)
    return ds.assign(
        x_score=(dims, x), y_score=(dims, y), x_text=(dims, x_text), y_text=(dims, y_text),
        x_answer_start=(dims, start), needle_depth=("doc", depth),
        answers=("doc", np.array([f'["{k}"]' for k in keys])), scorer=("doc", np.full(n_docs, "exact")),
        task=("doc", np.full(n_docs, "passkey")))
