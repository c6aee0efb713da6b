"""Tabular kernels and the one-step law of the stepwise maximal coupling (docs/statistics.md §1-2).

A *kernel* is a callable ``history: tuple[int, ...] -> probabilities over the
vocabulary``; the history is the branch's own emitted tokens.  ``exact``,
``simulate`` and ``extremal_kernels`` all go through :class:`CoupledKernels`, so
EOS absorption, validation and the coupling law are defined in one place.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import numpy as np

__all__ = ["SUM_TOL", "CoupledKernels", "Kernel", "StepLaw", "inverse_cdf_draw", "step_law"]

Kernel = Callable[[tuple[int, ...]], np.ndarray]

#: Probability vectors must sum to one within this tolerance (then renormalised).
SUM_TOL = 1e-6


@dataclass(frozen=True)
class StepLaw:
    """The coupling's law at one step given the two histories.

    ``shared`` is min(p, q) / (1 - tv), ``x_res`` is (p - q)+ / tv and ``y_res``
    is (q - p)+ / tv (each None when its mass is zero).
    """

    p: np.ndarray
    q: np.ndarray
    tv: float
    shared: np.ndarray | None
    x_res: np.ndarray | None
    y_res: np.ndarray | None


def _normalise(name: str, vec: np.ndarray) -> np.ndarray:
    total = vec.sum()
    if not np.isfinite(total) or abs(total - 1.0) > SUM_TOL or (vec < 0).any():
        raise ValueError(f"kernel {name} returned a vector that is not a probability law: {vec!r}")
    return vec / total


def step_law(p: np.ndarray, q: np.ndarray) -> StepLaw:
    """Split (p, q) into the shared part and the two residuals of the maximal coupling.

    Parameters
    ----------
    p, q : numpy.ndarray
        Probability vectors over the same tokens.

    Returns
    -------
    StepLaw
        tv, the shared law and the two residual laws (None where the mass is 0).

    Examples
    --------
    >>> import numpy as np
    >>> law = step_law(np.array([0.6, 0.4]), np.array([0.5, 0.5]))
    >>> round(law.tv, 10), law.x_res.tolist(), law.y_res.tolist()
    (0.1, [1.0, 0.0], [0.0, 1.0])
    """
    common = np.minimum(p, q)
    xr_ = np.maximum(p - q, 0.0)   # = clip(p - q, 0, None), at a fraction of np.clip's call cost
    yr_ = np.maximum(q - p, 0.0)
    # tv from the residual mass (not 1 - sum(min)) so that tiny TVs keep full precision;
    # the two residual masses agree up to rounding, and both must be positive.
    sx, sy = xr_.sum(), yr_.sum()
    tv = 0.0 if (sx <= 0.0 or sy <= 0.0) else float(min(1.0, 0.5 * (sx + sy)))
    sc = common.sum()
    if sc <= 0.0:
        tv = 1.0
    return StepLaw(
        p=p, q=q, tv=tv,
        shared=common / sc if (tv < 1.0 and sc > 0.0) else None,
        x_res=xr_ / sx if tv > 0.0 else None,
        y_res=yr_ / sy if tv > 0.0 else None,
    )


class CoupledKernels:
    """The pair (P, Q) with EOS absorption enforced and every evaluation memoised.

    P is evaluated on X's history and Q on Y's history.  Once a history ends with
    EOS its kernel is the point mass on EOS whatever the callable says (docs/statistics.md §1).
    """

    def __init__(self, p: Kernel, q: Kernel, vocab_size: int, eos: int | None = None) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        eos = None if eos is None or eos < 0 else int(eos)  # -1 is the schema's "no EOS"
        if eos is not None and eos >= vocab_size:
            raise ValueError(f"eos {eos} is not a token of a vocabulary of size {vocab_size}")
        self.vocab_size = int(vocab_size)
        self.eos = eos
        self._p, self._q = p, q
        self._cache_p: dict[tuple[int, ...], np.ndarray] = {}
        self._cache_q: dict[tuple[int, ...], np.ndarray] = {}
        self._cache_law: dict[tuple[tuple[int, ...], tuple[int, ...]], StepLaw] = {}
        # step_law is a function of the two vectors' values; many histories share them (a Markov
        # kernel has V rows), so the laws are also kept by value: the histories grow as V^t,
        # the distinct vector pairs do not
        self._law_by_value: dict[tuple[bytes, bytes], StepLaw] = {}
        # likewise the checked, renormalised vectors: the checks cost more than the kernel call
        self._normalised: dict[bytes, np.ndarray] = {}
        self._eos_mass = None
        if self.eos is not None:
            self._eos_mass = np.zeros(self.vocab_size)
            self._eos_mass[self.eos] = 1.0

    def ended(self, history: tuple[int, ...]) -> bool:
        return self.eos is not None and len(history) > 0 and history[-1] == self.eos

    def _eval(self, name: str, fn: Kernel, cache: dict, history: tuple[int, ...]) -> np.ndarray:
        out = cache.get(history)
        if out is None:
            if self.ended(history):
                out = self._eos_mass
            else:
                vec = np.asarray(fn(history), dtype=np.float64).reshape(-1)
                if vec.shape != (self.vocab_size,):
                    raise ValueError(
                        f"kernel {name} returned shape {vec.shape}, expected ({self.vocab_size},)")
                key = vec.tobytes()
                out = self._normalised.get(key)
                if out is None:
                    out = self._normalised[key] = _normalise(name, vec)
            cache[history] = out
        return out

    def p(self, history: tuple[int, ...]) -> np.ndarray:
        return self._eval("p", self._p, self._cache_p, history)

    def q(self, history: tuple[int, ...]) -> np.ndarray:
        return self._eval("q", self._q, self._cache_q, history)

    def law(self, x_hist: tuple[int, ...], y_hist: tuple[int, ...]) -> StepLaw:
        key = (x_hist, y_hist)
        out = self._cache_law.get(key)
        if out is None:
            p, q = self.p(x_hist), self.q(y_hist)
            values = (p.tobytes(), q.tobytes())
            out = self._law_by_value.get(values)
            if out is None:
                out = self._law_by_value[values] = step_law(p, q)
            self._cache_law[key] = out
        return out


def inverse_cdf_draw(probs: np.ndarray, u: float) -> int:
    """The token whose CDF step holds ``u`` times the total mass; never a zero-mass token.

    The simulators call this once per simulated token, on vectors of a handful of
    entries, where numpy's per-call overhead was 5x the work; in Python floats it is
    the same draw as ``np.searchsorted(np.cumsum(probs), u * total, side="right")``
    (``accumulate`` adds in the same order; tests/test_divstats_estimators.py pins
    ``simulate``'s draws to those of the numpy version).

    Parameters
    ----------
    probs : numpy.ndarray
        Non-negative float64 weights (need not sum to one).
    u : float
        A uniform draw in [0, 1).

    Returns
    -------
    int
        The index drawn.

    Examples
    --------
    >>> inverse_cdf_draw(np.array([0.5, 0.0, 0.5]), 0.5)
    2
    """
    cdf = list(accumulate(probs.tolist()))
    return min(bisect_right(cdf, float(u) * cdf[-1]), len(cdf) - 1)
