"""Speculative decoding with Q as the draft and P as the verifier, exactly and by simulation (docs/statistics.md §10).

One target call: Q drafts up to γ tokens; P accepts draft i with probability
min(1, p_i(y_i)/q_i(y_i)); at the first rejection the call emits a token of
norm((p_i − q_i)+) and ends; after γ acceptances it emits a bonus token of
p_{γ+1}.  The output is P-distributed.  A run produces N = min(T, first EOS)
tokens; the call that crosses T is counted and its extra tokens are cut.

:func:`exact_target_calls` enumerates the algorithm itself (draft from q, accept
or resample from the residual, bonus from p) over the pairs (output history,
drafts accepted so far in the running call), so it shares nothing with the
estimator of ``divstats.estimation.speculative``, which works from the lemma that
the acceptances are Bernoulli(min(1, q/p)) given P's path.
:func:`simulate_speculative` runs the algorithm with random numbers, as a decoder does.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from divstats.truth.kernels import CoupledKernels, Kernel, inverse_cdf_draw

__all__ = ["SpeculativeExact", "SpeculativeRuns", "exact_target_calls", "simulate_speculative"]


def _check_gamma(gamma: int) -> int:
    if isinstance(gamma, bool) or not isinstance(gamma, (int, np.integer)) or gamma < 1:
        raise ValueError(f"gamma (drafts per target call) must be an integer >= 1, got {gamma!r}")
    return int(gamma)


@dataclass(frozen=True)
class SpeculativeExact:
    """The speculative-decoding estimands of one kernel pair at one γ, computed exactly.

    Attributes
    ----------
    gamma, horizon : int
        γ and T.
    target_calls : float
        E[C]: target calls until the output holds N = min(T, first EOS) tokens.
    tokens : float
        E[N] (T without EOS).
    accepted : float
        E[A]: accepted drafts among the N output tokens.
    tokens_per_call, accepted_per_call : float
        E[N] / E[C] and E[A] / E[C].
    n_states : int
        (history, drafts accepted) states enumerated.
    """

    gamma: int
    horizon: int
    target_calls: float
    tokens: float
    accepted: float
    tokens_per_call: float
    accepted_per_call: float
    n_states: int = 0


def exact_target_calls(
    p: Kernel,
    q: Kernel,
    vocab_size: int,
    horizon: int,
    gamma: int,
    eos: int | None = None,
) -> SpeculativeExact:
    """Enumerate speculative decoding with draft Q and target P, and return its estimands exactly.

    Parameters
    ----------
    p, q : callable
        Kernels: a history (tuple of the output's tokens) → probabilities over
        ``vocab_size`` tokens.  Both are evaluated on the output history, which is
        the draft's prefix at every drafted position that matters.
    vocab_size : int
        V.
    horizon : int
        T, the tokens to produce.
    gamma : int
        γ, drafts per target call.
    eos : int, optional
        End-of-sequence token: emitting it ends the run (its call is counted).

    Returns
    -------
    SpeculativeExact
        target_calls, tokens, accepted and their per-call ratios.

    Raises
    ------
    ValueError
        A horizon or γ below 1, or kernels that are not probability laws.

    Examples
    --------
    >>> import numpy as np
    >>> p = lambda h: np.array([0.6, 0.4])
    >>> q = lambda h: np.array([0.5, 0.5])
    >>> r = exact_target_calls(p, q, 2, horizon=1, gamma=1)
    >>> r.target_calls, round(r.accepted, 6)
    (1.0, 0.9)
    """
    if horizon < 1:
        raise ValueError(f"horizon must be >= 1, got {horizon}")
    g = _check_gamma(gamma)
    T = int(horizon)
    kern = CoupledKernels(p, q, vocab_size, eos)
    # state: (output history, drafts accepted so far in the running call) -> probability
    states: dict[tuple[tuple[int, ...], int], float] = {((), 0): 1.0}
    calls = tokens = accepted = 0.0
    n_states = 1
    for _ in range(T):
        nxt: dict[tuple[tuple[int, ...], int], float] = defaultdict(float)
        for (h, j), prob in states.items():
            if kern.ended(h):      # the run stopped at EOS: nothing more is produced
                continue
            tokens += prob
            if j == 0:
                calls += prob      # this position opens a target call
            pv = kern.p(h)
            if j == g:             # the bonus token of a call whose γ drafts were all accepted
                for x in np.flatnonzero(pv):
                    nxt[(h + (int(x),), 0)] += prob * pv[x]
                continue
            qv = kern.q(h)
            with np.errstate(divide="ignore", invalid="ignore"):
                accept = np.where(qv > 0, np.minimum(1.0, pv / np.where(qv > 0, qv, 1.0)), 0.0)
            for y in np.flatnonzero(qv):       # the draft y ~ q, accepted with min(1, p/q)
                mass = prob * qv[y] * accept[y]
                if mass > 0:
                    nxt[(h + (int(y),), j + 1)] += mass
                    accepted += mass
            reject = prob * float((qv * (1.0 - accept)).sum())
            if reject > 0:                      # rejected: resample from norm((p - q)+), the call ends
                resid = np.clip(pv - qv, 0.0, None)
                resid = resid / resid.sum()
                for z in np.flatnonzero(resid):
                    nxt[(h + (int(z),), 0)] += reject * resid[z]
        states = nxt
        n_states += len(states)
    calls, tokens, accepted = float(calls), float(tokens), float(accepted)
    return SpeculativeExact(gamma=g, horizon=T, target_calls=calls, tokens=tokens, accepted=accepted,
                            tokens_per_call=tokens / calls, accepted_per_call=accepted / calls,
                            n_states=n_states)


@dataclass(frozen=True)
class SpeculativeRuns:
    """Runs of the simulated algorithm: per-run counts, shape (replicates,).

    Attributes
    ----------
    gamma, horizon : int
        γ and T.
    calls, tokens, accepted : numpy.ndarray
        Target calls, output tokens (N) and accepted drafts of each run.
    """

    gamma: int
    horizon: int
    calls: np.ndarray
    tokens: np.ndarray
    accepted: np.ndarray


def simulate_speculative(
    p: Kernel,
    q: Kernel,
    vocab_size: int,
    horizon: int,
    gamma: int,
    replicates: int,
    seed: int = 0,
    eos: int | None = None,
) -> SpeculativeRuns:
    """Run speculative decoding (draft from Q, verify with P, resample) ``replicates`` times.

    Each call drafts γ tokens from Q along its own draft prefix, then P verifies
    them in order: draft i is accepted when u < min(1, p(y_i)/q(y_i)); the first
    rejection emits a token of norm((p − q)+) and ends the call; γ acceptances
    earn a bonus token of P.  A run ends once T tokens are out (the last call's
    surplus is cut) or EOS is emitted.

    Parameters
    ----------
    p, q : callable
        Kernels, as for :func:`exact_target_calls`.
    vocab_size, horizon, gamma : int
        V, T and γ.
    replicates : int
        Runs.
    seed : int
        Seed of ``numpy.random.default_rng``.
    eos : int, optional
        End-of-sequence token.

    Returns
    -------
    SpeculativeRuns
        calls, tokens and accepted drafts per run.

    Raises
    ------
    ValueError
        Sizes below 1.

    Examples
    --------
    >>> import numpy as np
    >>> p = lambda h: np.array([0.6, 0.4])
    >>> runs = simulate_speculative(p, p, 2, horizon=10, gamma=4, replicates=3)
    >>> runs.calls.tolist()   # Q = P: every draft is accepted, 5 tokens per call
    [2, 2, 2]
    """
    if horizon < 1 or replicates < 1:
        raise ValueError("horizon and replicates must be >= 1")
    g = _check_gamma(gamma)
    T, n = int(horizon), int(replicates)
    kern = CoupledKernels(p, q, vocab_size, eos)
    rng = np.random.default_rng(seed)
    calls = np.zeros(n, dtype=np.int64)
    tokens = np.zeros(n, dtype=np.int64)
    accepted = np.zeros(n, dtype=np.int64)
    for r in range(n):
        out: tuple[int, ...] = ()
        while len(out) < T and not kern.ended(out):
            calls[r] += 1
            drafts: list[int] = []
            dq: list[np.ndarray] = []
            h = out
            for _ in range(g):                         # the draft model runs ahead on its own draft
                qv = kern.q(h)
                y = inverse_cdf_draw(qv, rng.random())
                drafts.append(y)
                dq.append(qv)
                h = h + (y,)
            emitted: list[int] = []
            n_acc = 0
            h = out
            for y, qv in zip(drafts, dq, strict=True):   # the target verifies them in order
                pv = kern.p(h)
                if rng.random() < min(1.0, pv[y] / qv[y]):
                    emitted.append(y)
                    n_acc += 1
                    h = h + (y,)
                    continue
                resid = np.clip(pv - qv, 0.0, None)
                emitted.append(inverse_cdf_draw(resid / resid.sum(), rng.random()))
                break
            else:
                emitted.append(inverse_cdf_draw(kern.p(h), rng.random()))   # bonus token
            keep = _cut(emitted, T - len(out), kern)
            accepted[r] += min(n_acc, keep)
            out = out + tuple(emitted[:keep])
        tokens[r] = len(out)
    return SpeculativeRuns(gamma=g, horizon=T, calls=calls, tokens=tokens, accepted=accepted)


def _cut(emitted: Sequence[int], room: int, kern: CoupledKernels) -> int:
    """How many of a call's tokens the run keeps: up to the room left and the first EOS."""
    keep = min(len(emitted), room)
    for i in range(keep):
        if kern.ended(tuple(emitted[: i + 1])):
            return i + 1
    return keep
