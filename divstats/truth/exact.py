"""Exact enumeration of the stepwise maximal coupling for small tabular kernels (docs/statistics.md §2-3, §9).

The joint state after t steps is the pair of histories (x_<=t, y_<=t) together with
the divergence time tau (0 while the histories agree).  A forward pass over the
reachable states with their probabilities gives every estimand by linearity of
expectation, so nothing is sampled and the answers are exact up to rounding.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from divstats.truth.kernels import CoupledKernels, Kernel

__all__ = ["ExactResult", "exact"]


@dataclass(frozen=True)
class ExactResult:
    """Every estimand of docs/statistics.md §3 and §6 for one kernel pair, computed exactly.

    Attributes are the estimands; ``result["name"]`` works too.  ``survival`` is
    indexed by t = 0..T and ``branch_tv`` by age k = 0..T-1 (NaN where
    P(tau + k <= T) = 0).  ``loss`` and ``post_mismatch`` are always the true values
    (enumeration sees everything); ``loss_lower``/``loss_upper`` are the sharp
    interval an observer of ``window`` post-divergence steps could report.
    """

    horizon: int
    window: int
    occurrence: float
    survival: np.ndarray
    rmtd: float
    agreeing_tokens: float
    exposure: float
    post_mismatch: float
    rate: float
    loss: float
    mismatch_fraction: float
    first_mismatch_contribution: float
    exposure_contribution: float
    window_mismatch: float
    tail_capacity: float
    loss_lower: float
    loss_upper: float
    branch_tv: np.ndarray
    n_states: int = field(default=0, compare=False)

    def __getitem__(self, name: str) -> Any:
        if name not in self.names():
            raise KeyError(name)
        return getattr(self, name)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if f.name not in ("horizon", "window", "n_states"))

    def as_dict(self) -> dict[str, Any]:
        return {n: getattr(self, n) for n in self.names()}


def _resolve_window(window: int | None, horizon: int) -> int:
    if window is None:
        return horizon
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    return int(window)


def exact(
    p: Kernel,
    q: Kernel,
    vocab_size: int,
    horizon: int,
    window: int | None = None,
    eos: int | None = None,
) -> ExactResult:
    """Enumerate the coupled process of docs/statistics.md §2 and return every estimand exactly.

    Parameters
    ----------
    p, q : callables mapping a history (tuple of the branch's own tokens) to a
        probability vector of length ``vocab_size``; P is evaluated on X's history,
        Q on Y's.
    vocab_size, horizon : V and T.
    window : W, post-divergence steps observed (None = T: branches run to the end).
        Only ``window_mismatch``, ``tail_capacity`` and the interval depend on it.
    eos : absorbing end-of-sequence token, or None.

    Returns
    -------
    ExactResult
        Every estimand, with the number of enumerated states.

    Raises
    ------
    ValueError
        For a horizon below 1, a negative window, or kernels that are not probability laws.

    Examples
    --------
    >>> import numpy as np
    >>> p = lambda h: np.array([0.6, 0.4])
    >>> q = lambda h: np.array([0.5, 0.5])
    >>> r = exact(p, q, 2, horizon=3)
    >>> round(r.occurrence, 6), bool(np.isclose(r.loss, r.occurrence + r.exposure * r.rate))
    (0.271, True)
    """
    if horizon < 1:
        raise ValueError(f"horizon must be >= 1, got {horizon}")
    T = int(horizon)
    W = _resolve_window(window, T)
    kern = CoupledKernels(p, q, vocab_size, eos)
    acc = _Sums(diverge_at=np.zeros(T + 1), bt_num=np.zeros(T))
    # state: (x history, y history, tau) -> probability; tau = 0 while they agree
    states: dict[_State, float] = {((), (), 0): 1.0}
    n_states = 1
    for t in range(1, T + 1):
        states, n_next = _step(states, t, W, kern, acc, build_next=t < T)
        n_states += n_next
        # The observation window closes after step tau + W; what is left of the horizon
        # is the tail, which counts unless both branches have already ended.
        if t < T:
            for (xh, yh, tau), prob in states.items():
                if tau and t - tau == W and not (kern.ended(xh) and kern.ended(yh)):
                    acc.tail += prob * (T - t)
    return _assemble(T, W, acc.diverge_at, acc.post, acc.win, acc.tail, acc.bt_num, n_states)


_State = tuple[tuple[int, ...], tuple[int, ...], int]


@dataclass
class _Sums:
    """The expectations ``exact`` accumulates over the enumerated states."""

    diverge_at: np.ndarray           # P(tau = t), t = 1..T
    bt_num: np.ndarray               # E[delta_{tau+k} 1[tau + k <= T]]
    post: float = 0.0                # E[R] = sum_t P(D_t = 1, tau < t)
    win: float = 0.0                 # E[sum_{tau < t <= tau + W} D_t]
    tail: float = 0.0                # E[(T - tau - K) 1[not both ended at tau + K]; tau <= T]


def _step(states: dict[_State, float], t: int, W: int, kern: CoupledKernels, acc: _Sums,
          build_next: bool = True) -> tuple[dict[_State, float], int]:
    """Step t of the coupled process: add its mismatch terms to ``acc``, return the next states and their number.

    After the last step the next states are only counted (``build_next=False``): each state's
    children extend its own (distinct) histories, so they are distinct, one per token (pair)
    of positive mass; building that largest layer was most of ``exact``'s time.
    """
    nxt: dict[_State, float] = defaultdict(float)
    n_next = 0
    for (xh, yh, tau), prob in states.items():
        law = kern.law(xh, yh)
        d = law.tv
        if tau == 0:
            acc.diverge_at[t] += prob * d
            acc.bt_num[0] += prob * d * d
        else:
            k = t - tau
            acc.bt_num[k] += prob * d
            acc.post += prob * d
            if k <= W:
                acc.win += prob * d
        # Python floats from .tolist(): the same doubles as the numpy scalars, without their
        # per-element cost (this loop is ~all of exact's time)
        if not build_next:
            n_next += (0 if law.shared is None else int(np.count_nonzero(law.shared))) + (
                0 if law.x_res is None else int(np.count_nonzero(law.x_res)) * int(np.count_nonzero(law.y_res)))
            continue
        if law.shared is not None:
            stay = prob * (1.0 - d)
            for v, pv in enumerate(law.shared.tolist()):
                if pv != 0:
                    nxt[(xh + (v,), yh + (v,), tau)] += stay * pv
        if law.x_res is not None:
            new_tau = tau if tau else t
            y_res = [(b, pb) for b, pb in enumerate(law.y_res.tolist()) if pb != 0]
            for a, pxa in enumerate(law.x_res.tolist()):
                if pxa == 0:
                    continue
                pa = prob * d * pxa
                xa = xh + (a,)
                for b, pb in y_res:
                    nxt[(xa, yh + (b,), new_tau)] += pa * pb
    return nxt, (len(nxt) if build_next else n_next)


def _assemble(T: int, W: int, diverge_at: np.ndarray, post: float, win: float, tail: float,
              bt_num: np.ndarray, n_states: int) -> ExactResult:
    t = np.arange(T + 1)
    survival = 1.0 - np.cumsum(diverge_at)
    survival[0] = 1.0
    occurrence = float(diverge_at.sum())
    exposure = float((diverge_at * (T - t)).sum())
    rate = post / exposure if exposure > 0 else float("nan")
    contrib = exposure * rate if exposure > 0 else 0.0
    loss = occurrence + contrib
    # P(tau + k <= T) = P(tau <= T - k)
    denom = np.array([diverge_at[: T - k + 1].sum() for k in range(T)])
    with np.errstate(invalid="ignore", divide="ignore"):
        branch_tv = np.where(denom > 0, bt_num / np.where(denom > 0, denom, 1.0), np.nan)
    loss_lower = occurrence + win
    return ExactResult(
        horizon=T, window=W,
        occurrence=occurrence, survival=survival, rmtd=float(survival[:T].sum()),
        agreeing_tokens=float(survival[1:].sum()),  # E[min(tau - 1, T)] = sum_{t=1}^{T} S(t)
        exposure=exposure, post_mismatch=post, rate=rate, loss=loss,
        mismatch_fraction=occurrence / T + contrib / T,
        first_mismatch_contribution=occurrence / T, exposure_contribution=contrib / T,
        window_mismatch=win, tail_capacity=tail, loss_lower=loss_lower,
        loss_upper=loss_lower + tail, branch_tv=branch_tv, n_states=n_states,
    )
