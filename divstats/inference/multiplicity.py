"""Multiplicity and the one rejection rule (docs/plans.md).

:func:`holm` applies statsmodels' Holm step-down within one family.  One rejection rule
everywhere (:func:`rejects`): reject when the (adjusted) p-value is <= alpha; NaN (not
estimable) never rejects.
"""

from __future__ import annotations

import numpy as np

__all__ = ["holm", "rejects"]


def rejects(pvalue, alpha: float):
    """The one rejection rule: reject when the (adjusted) p-value is <= alpha; NaN never rejects.

    Parameters
    ----------
    pvalue : float or numpy.ndarray
        (Adjusted) p-values; NaN means not estimable.
    alpha : float
        The level.

    Returns
    -------
    bool or numpy.ndarray
        The decision(s).

    Examples
    --------
    >>> rejects(0.05, 0.05), rejects(float("nan"), 0.05)
    (True, False)
    """
    p = np.asarray(pvalue, dtype=float)
    out = np.nan_to_num(p, nan=np.inf) <= alpha
    return bool(out) if out.ndim == 0 else out


def holm(pvalues: np.ndarray, alpha: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Holm step-down within one family: ``(reject, p_adjusted)``; NaN p-values stay NaN.

    ``p_adjusted`` is statsmodels' Holm adjustment; ``reject`` is :func:`rejects`
    (p_adjusted <= alpha), the same rule as an unadjusted test.
    Parameters
    ----------
    pvalues : numpy.ndarray
        The family's p-values (NaN: not evaluated).
    alpha : float
        The family's level.

    Returns
    -------
    (numpy.ndarray, numpy.ndarray)
        Boolean rejections and adjusted p-values.

    Examples
    --------
    >>> import numpy as np
    >>> reject, adj = holm(np.array([0.01, 0.04, np.nan]))
    >>> reject.tolist(), [round(float(x), 2) for x in adj]
    ([True, True, False], [0.02, 0.04, nan])
    """
    from statsmodels.stats.multitest import multipletests  # lazy: statsmodels is heavy and only holm needs it

    p = np.asarray(pvalues, dtype=float)
    adjusted = np.full(p.shape, np.nan)
    ok = np.isfinite(p)
    if ok.any():
        adjusted[ok] = multipletests(p[ok], alpha=alpha, method="holm")[1]
    return rejects(adjusted, alpha), adjusted
