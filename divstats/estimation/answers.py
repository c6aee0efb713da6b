"""Per-document answer scores: what P and Q answered, averaged within each document (docs/statistics.md §12).

Traces that carry task outcomes (``coupled`` traces with the optional score variables, or
the ``answers`` kind) hold ``x_score`` and ``y_score`` over (doc, policy, replicate): the
score in [0, 1] of P's (full cache) and Q's (the policy's) answer on that replicate, NaN
where it was not scored.  The document is the unit of inference, so every answer
statistic starts from the per-document means below (replicates averaged within the
document first, equal document weights after).

:data:`~divstats.estimands.ANSWER_ESTIMANDS` names the two per-document estimands a plan
may test (``accuracy``, ``accuracy_change``); :func:`answer_values` computes them, and
``divstats.report.analysis.compute`` and ``divstats.plans.run`` merge them beside
``divstats.estimate``'s variables.  This module depends on numpy and xarray only.
"""

from __future__ import annotations

import numpy as np
import xarray as xr

from divstats.errors import DivstatsError
from divstats.estimands import ACCURACY, ACCURACY_CHANGE, ANSWER_ESTIMANDS

__all__ = ["SCORE_VARS", "answer_values", "has_answers", "score_arrays", "with_answer_values"]

#: The score variables: P's and Q's answer scores in [0, 1], NaN = not scored.
SCORE_VARS: tuple[str, str] = ("x_score", "y_score")


def has_answers(ds: xr.Dataset) -> bool:
    """Whether ``ds`` carries both answer-score variables with at least one scored pair.

    Parameters
    ----------
    ds : xarray.Dataset
        A trace dataset.

    Returns
    -------
    bool

    Examples
    --------
    >>> import xarray as xr
    >>> has_answers(xr.Dataset())
    False
    """
    if not all(v in ds.data_vars for v in SCORE_VARS):
        return False
    return bool((ds["x_score"].notnull() & ds["y_score"].notnull()).any())


def score_arrays(ds: xr.Dataset) -> tuple[xr.DataArray, xr.DataArray]:
    """P's and Q's scores as float DataArrays, checked to lie in [0, 1] (NaN allowed).

    Parameters
    ----------
    ds : xarray.Dataset
        Traces with ``x_score`` and ``y_score`` over (doc, policy, replicate).

    Returns
    -------
    (xarray.DataArray, xarray.DataArray)

    Raises
    ------
    DivstatsError
        A score variable missing, without a ``replicate`` dim, or outside [0, 1].

    Examples
    --------
    >>> import xarray as xr
    >>> v = xr.DataArray([[0.0, 1.5]], dims=("doc", "replicate"))
    >>> try:
    ...     score_arrays(xr.Dataset({"x_score": v, "y_score": v}))
    ... except DivstatsError as exc:
    ...     print(exc)
    x_score: scores must lie in [0, 1] (NaN = not scored); 1.5 at {'doc': 0, 'replicate': 1}
    """
    out = []
    for name in SCORE_VARS:
        if name not in ds.data_vars:
            raise DivstatsError(f"traces have no {name!r}: answer statistics need P's and Q's scores "
                                "(x_score, y_score over doc, policy, replicate)")
        v = ds[name].astype(np.float64)
        if "replicate" not in v.dims or "doc" not in v.dims:
            raise DivstatsError(f"{name}: dims {v.dims} must include doc and replicate")
        bad = v.notnull() & ((v < 0) | (v > 1))
        if bool(bad.any()):
            where = {d: str(v[d].values[i[0]]) if d in v.coords else int(i[0])
                     for d, i in zip(v.dims, np.nonzero(bad.values), strict=True)}
            raise DivstatsError(f"{name}: scores must lie in [0, 1] (NaN = not scored); "
                                f"{float(v.values[bad.values][0])!r} at {where}")
        out.append(v)
    return out[0], out[1]


def answer_values(ds: xr.Dataset) -> xr.Dataset:
    """Per-document answer estimands: Q's accuracy and its change from P's (replicates averaged).

    ``accuracy`` is the mean of Q's scores over the document's scored replicates;
    ``accuracy_change`` the mean of Q's minus P's score over the replicates where both
    were scored (the coupled pairs); each with ``_se`` (the standard error of that mean
    over replicates, NaN with one replicate) and ``_n`` (the replicates used).

    Parameters
    ----------
    ds : xarray.Dataset
        Traces with ``x_score`` and ``y_score``.

    Returns
    -------
    xarray.Dataset
        Over ``ds``'s dims other than ``replicate`` (doc, policy[, model]); empty when the
        traces carry no scores.

    Examples
    --------
    >>> import numpy as np, xarray as xr
    >>> x = xr.DataArray(np.array([[[1.0, 1.0]], [[0.0, 1.0]]]), dims=("doc", "policy", "replicate"))
    >>> ds = xr.Dataset({"x_score": x, "y_score": x * 0 + np.array([0.0, 1.0])})
    >>> answer_values(ds)["accuracy_change"].values.ravel().tolist()
    [-0.5, 0.0]
    """
    if not all(v in ds.data_vars for v in SCORE_VARS):
        return xr.Dataset()
    x, y = score_arrays(ds)
    d = (y - x)          # NaN where either side is unscored: no pair
    desc = {e.name: e.description for e in ANSWER_ESTIMANDS}
    out = {}
    for name, v in ((ACCURACY, y), (ACCURACY_CHANGE, d)):
        n = v.notnull().sum("replicate")
        mean = v.mean("replicate", skipna=True)
        se = (v.std("replicate", ddof=1, skipna=True) / np.sqrt(n)).where(n >= 2)
        out[name] = mean.assign_attrs(description=desc[name])
        out[name + "_se"] = se.assign_attrs(description=f"standard error over replicates of {name}")
        out[name + "_n"] = n.assign_attrs(description=f"replicates used for {name}")
    return xr.Dataset(out)


def with_answer_values(est: xr.Dataset, traces: xr.Dataset) -> xr.Dataset:
    """``est`` with the per-document answer estimands beside it (when the traces carry scores).

    Parameters
    ----------
    est : xarray.Dataset
        ``divstats.estimate(traces)``.
    traces : xarray.Dataset
        The traces.

    Returns
    -------
    xarray.Dataset
        ``est`` unchanged without scores; else with :func:`answer_values`' variables
        (``accuracy``, ``accuracy_change``, their ``_se`` and ``_n``) over (doc, policy[, model]).

    Examples
    --------
    >>> import numpy as np, xarray as xr
    >>> x = xr.DataArray(np.ones((2, 1, 2)), dims=("doc", "policy", "replicate"))
    >>> est = xr.Dataset({"occurrence": x.isel(replicate=0)})
    >>> sorted(with_answer_values(est, xr.Dataset({"x_score": x, "y_score": x}))
    ...        .data_vars)[:3]
    ['accuracy', 'accuracy_change', 'accuracy_change_n']
    """
    if not has_answers(traces):
        return est
    return est.assign(dict(answer_values(traces).data_vars))
