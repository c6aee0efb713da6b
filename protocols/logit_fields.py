"""Logit traces (docs/contract.md §1, "Logit traces"): the optional top-k variables of ``kvdiv.trace/1``.

A producer asked for ``top_logprobs: k`` adds to every step (and every branch age),
per replicate, P's and Q's top-k tokens of their processed next-token laws, each
model's log-probability of both top-k sets, and four summaries computed on the whole
vocabulary: KL(P‖Q), KL(Q‖P) and the two entropies. This module names them once:

=================  =============  ==========================================================
field              trailing dim   meaning (P = full-cache law, Q = evicted-cache law)
=================  =============  ==========================================================
``p_top_token``    ``top``        P's k most likely tokens, most likely first
``p_top_logp``     ``top``        log p of P's top-k (non-increasing)
``p_top_logq``     ``top``        log q of P's top-k (-inf where q is 0)
``q_top_token``    ``top``        Q's k most likely tokens, most likely first
``q_top_logq``     ``top``        log q of Q's top-k (non-increasing)
``q_top_logp``     ``top``        log p of Q's top-k (-inf where p is 0)
``kl_pq``                         KL(P‖Q) in nats (+inf where P has mass Q lacks)
``kl_qp``                         KL(Q‖P) in nats
``entropy_p``                     H(P) in nats
``entropy_q``                     H(Q) in nats
=================  =============  ==========================================================

Dataset variables carry the field name behind the prefix of the path they belong to:
none for coupled (and reference) traces on ``step``; ``shared_`` (on ``step``) and
``branch_`` (on ``age``) for residual traces. Unobserved cells are NaN / -1 like the
rest of the contract.

On the wire the fields ride in one ``logits`` object of each ``step``, ``shared_step``
and ``branch`` record, one entry per replicate (per age in a branch record), a row
that is not observed being ``null``. JSON has no infinities, so inside an observed
row ``null`` is the one value the field may take that JSON cannot hold: -inf for a
log-probability, +inf for a KL (:func:`wire_logits`, :func:`decode_rows`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

__all__ = ["FIELD_DOCS", "LOGIT_FIELDS", "LOGIT_SUMMARIES", "LOGIT_TOKENS", "LOGIT_TOP", "MAX_TOP_LOGPROBS",
           "PATH_DOCS", "TOP_DIM", "WIRE_KEY", "decode_rows", "law_summaries", "logit_prefixes", "logit_var_dims",
           "logit_vars", "wire_logits", "with_logits"]

#: The largest k a producer is asked for (``top_logprobs`` on /v1/traces).
MAX_TOP_LOGPROBS = 64
#: The dim of the k axis.
TOP_DIM = "top"
#: The record key holding the fields on the wire.
WIRE_KEY = "logits"
#: Fields with a trailing ``top`` axis, and the token-valued ones among them.
LOGIT_TOP = ("p_top_token", "p_top_logp", "p_top_logq", "q_top_token", "q_top_logq", "q_top_logp")
LOGIT_TOKENS = ("p_top_token", "q_top_token")
#: Per-step summaries on the full vocabulary.
LOGIT_SUMMARIES = ("kl_pq", "kl_qp", "entropy_p", "entropy_q")
LOGIT_FIELDS = LOGIT_TOP + LOGIT_SUMMARIES

#: What each field means (the variables' ``description`` attrs).
FIELD_DOCS: dict[str, str] = {
    "p_top_token": "P's top-k tokens of its processed next-token law, most likely first",
    "p_top_logp": "log p of P's top-k tokens (non-increasing along top)",
    "p_top_logq": "log q of P's top-k tokens (-inf where q is 0)",
    "q_top_token": "Q's top-k tokens of its processed next-token law, most likely first",
    "q_top_logq": "log q of Q's top-k tokens (non-increasing along top)",
    "q_top_logp": "log p of Q's top-k tokens (-inf where p is 0)",
    "kl_pq": "KL(P||Q) in nats on the full vocabulary (+inf where P has mass Q lacks)",
    "kl_qp": "KL(Q||P) in nats on the full vocabulary (+inf where Q has mass P lacks)",
    "entropy_p": "entropy of P's processed next-token law in nats",
    "entropy_q": "entropy of Q's processed next-token law in nats",
}

_BASE = ("doc", "policy", "replicate")
# protocols.schema's TOKEN_DTYPE and PROB_DTYPE (schema imports this module, so they are
# restated here; tests/test_logit_traces.py checks they agree)
_TOKEN_DTYPE, _PROB_DTYPE = np.int32, np.float32
#: What each path prefix adds to a variable's description.
PATH_DOCS = {"": "", "shared_": " (survival path)", "branch_": " (branches, by age)"}


def logit_prefixes(kind: str) -> dict[str, str]:
    """The variable prefixes of a kind and the time dim each one lives on.

    Parameters
    ----------
    kind : str
        A trace kind.

    Returns
    -------
    dict
        Prefix -> time dim: ``{"": "step"}``, or the residual kind's two paths.

    Raises
    ------
    None

    Examples
    --------
    >>> logit_prefixes("residual")
    {'shared_': 'step', 'branch_': 'age'}
    """
    return {"shared_": "step", "branch_": "age"} if kind == "residual" else {"": "step"}


def logit_var_dims(kind: str) -> dict[str, tuple[str, ...]]:
    """Every logit variable of a kind with its dims (the optional variables of docs/contract.md §1).

    Parameters
    ----------
    kind : str
        A trace kind.

    Returns
    -------
    dict
        Variable name -> dims, for every path of the kind.

    Raises
    ------
    None

    Examples
    --------
    >>> logit_var_dims("coupled")["p_top_logp"]
    ('doc', 'policy', 'replicate', 'step', 'top')
    >>> len(logit_var_dims("residual"))
    20
    """
    out: dict[str, tuple[str, ...]] = {}
    for prefix, time in logit_prefixes(kind).items():
        for name in LOGIT_FIELDS:
            out[prefix + name] = (*_BASE, time) + ((TOP_DIM,) if name in LOGIT_TOP else ())
    return out


def logit_vars(ds: Any) -> list[str]:
    """The logit variables a dataset holds (empty: none was asked for).

    Parameters
    ----------
    ds : xarray.Dataset
        A trace dataset.

    Returns
    -------
    list of str
        Its logit variables, in :func:`logit_var_dims` order.

    Raises
    ------
    None

    Examples
    --------
    >>> from protocols.examples import example_dataset
    >>> logit_vars(example_dataset())
    []
    """
    kind = ds.attrs.get("kind")
    return [name for name in logit_var_dims(kind) if name in ds.data_vars]


def law_summaries(p: np.ndarray, q: np.ndarray, k: int) -> dict[str, np.ndarray]:
    """Every logit field of two next-token laws, in numpy: the reference the engine's torch code
    (``gen_service.engine.top_logprobs``) is tested against, and the producer of example traces.

    Parameters
    ----------
    p, q : numpy.ndarray
        Laws shaped (..., V), rows summing to 1.
    k : int
        The top-k size, 1..V.

    Returns
    -------
    dict
        :data:`LOGIT_FIELDS` -> arrays shaped (..., k) or (...); ties in a top-k go to the lower id.

    Raises
    ------
    ValueError
        ``k`` outside 1..V or laws of different shapes.

    Examples
    --------
    >>> f = law_summaries(np.array([0.5, 0.5, 0.0]), np.array([0.25, 0.25, 0.5]), 2)
    >>> f["p_top_token"].tolist(), f["q_top_token"].tolist(), round(float(f["kl_pq"]), 4)
    ([0, 1], [2, 0], 0.6931)
    """
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    if p.shape != q.shape or not 1 <= k <= p.shape[-1]:
        raise ValueError(f"laws of shapes {p.shape}, {q.shape} and k = {k}: need equal shapes and 1 <= k <= V")
    with np.errstate(divide="ignore", invalid="ignore"):
        lp, lq = np.log(p), np.log(q)
        out: dict[str, np.ndarray] = {}
        for a, la, lb in (("p", lp, lq), ("q", lq, lp)):
            ids = np.argsort(-la, axis=-1, kind="stable")[..., :k]
            b = "q" if a == "p" else "p"
            out[f"{a}_top_token"] = ids
            out[f"{a}_top_log{a}"] = np.take_along_axis(la, ids, -1)
            out[f"{a}_top_log{b}"] = np.take_along_axis(lb, ids, -1)
        kl = {}
        for name, a, la, lb in (("kl_pq", p, lp, lq), ("kl_qp", q, lq, lp)):
            kl[name] = np.where(a > 0, a * (la - lb), 0.0).sum(-1)
        out.update(kl)
        out["entropy_p"] = -np.where(p > 0, p * lp, 0.0).sum(-1)
        out["entropy_q"] = -np.where(q > 0, q * lq, 0.0).sum(-1)
    return out


def _row(value: Any, *, token: bool) -> Any:
    """One JSON-safe value: non-finite floats and negative ids become null."""
    if token:
        return None if value < 0 else int(value)
    return float(value) if np.isfinite(value) else None


def wire_logits(fields: Mapping[str, Sequence[Any]], observed: Sequence[bool] | None = None) -> dict[str, list]:
    """The ``logits`` object of one wire record: per row (replicate or branch age) each field.

    Parameters
    ----------
    fields : mapping
        Every name of :data:`LOGIT_FIELDS` to one entry per row: a length-k list for the
        top fields, a number for the summaries (nested lists, numpy arrays).
    observed : sequence of bool, optional
        Rows to send; the others are ``null`` (default: all).

    Returns
    -------
    dict
        Field name -> list of rows, JSON-safe (non-finite values are ``null``).

    Raises
    ------
    KeyError
        A field is missing.

    Examples
    --------
    >>> f = {"p_top_token": [[3]], "p_top_logp": [[0.0]], "p_top_logq": [[float("-inf")]],
    ...      "q_top_token": [[4]], "q_top_logq": [[0.0]], "q_top_logp": [[float("-inf")]],
    ...      "kl_pq": [float("inf")], "kl_qp": [float("inf")], "entropy_p": [0.0], "entropy_q": [0.0]}
    >>> wire_logits(f)["p_top_logq"], wire_logits(f)["kl_pq"]
    ([[None]], [None])
    """
    out: dict[str, list] = {}
    for name in LOGIT_FIELDS:
        rows = fields[name]
        token = name in LOGIT_TOKENS
        show = [True] * len(rows) if observed is None else list(observed)
        if name in LOGIT_TOP:
            out[name] = [[_row(v, token=token) for v in row] if s else None for row, s in zip(rows, show, strict=True)]
        else:
            out[name] = [_row(v, token=False) if s else None for v, s in zip(rows, show, strict=True)]
    return out


def decode_rows(objects: Sequence[Mapping[str, list] | None], rows: int, k: int) -> dict[str, np.ndarray]:
    """Wire ``logits`` objects (one per record) -> arrays shaped (record, row[, top]).

    A row is observed where its ``entropy_p`` is a number; there a ``null`` log-probability
    is -inf and a ``null`` KL is +inf (JSON has no infinities). Unobserved rows are NaN,
    their tokens -1.

    Parameters
    ----------
    objects : sequence of mapping
        The records' ``logits`` objects, already checked for shape by the stream reader.
    rows : int
        Rows per record (R, or the ages of a branch).
    k : int
        The top-k size.

    Returns
    -------
    dict
        Field name -> float64 array (tokens: float64 with NaN where missing, cast by the caller).

    Raises
    ------
    ValueError
        A value that is not a number.

    Examples
    --------
    >>> obj = {"p_top_token": [[3], None], "p_top_logp": [[0.0], None], "p_top_logq": [[None], None],
    ...        "q_top_token": [[3], None], "q_top_logq": [[0.0], None], "q_top_logp": [[0.0], None],
    ...        "kl_pq": [None, None], "kl_qp": [0.0, None], "entropy_p": [0.0, None], "entropy_q": [0.0, None]}
    >>> a = decode_rows([obj], 2, 1)
    >>> a["p_top_logq"][0, :, 0].tolist(), a["kl_pq"][0].tolist()
    ([-inf, nan], [inf, nan])
    """
    n = len(objects)
    seen = np.array([[v is not None for v in obj["entropy_p"]] for obj in objects], dtype=bool).reshape(n, rows)
    out: dict[str, np.ndarray] = {}
    for name in LOGIT_FIELDS:
        if name in LOGIT_TOP:
            a = np.array([[row if row is not None else [None] * k for row in obj[name]] for obj in objects],
                         dtype=np.float64).reshape(n, rows, k)
            if name not in LOGIT_TOKENS:
                a = np.where(seen[..., None] & np.isnan(a), -np.inf, a)
        else:
            a = np.array([obj[name] for obj in objects], dtype=np.float64).reshape(n, rows)
            if name.startswith("kl_"):
                a = np.where(seen & np.isnan(a), np.inf, a)
        out[name] = a
    return out


def with_logits(ds: xr.Dataset, arrays: Mapping[str, Any], prefix: str = "") -> xr.Dataset:
    """``ds`` with one path's logit variables added (``prefix``: ``""``, ``"shared_"`` or ``"branch_"``).

    Parameters
    ----------
    ds : xarray.Dataset
        A trace dataset built by :mod:`protocols.schema` (its kind decides the time dim).
    arrays : mapping
        Every name of :data:`LOGIT_FIELDS` to an array shaped (doc, policy, replicate, time[, top]),
        or (replicate, time[, top]) for one doc and one policy; tokens -1 and floats NaN where
        unobserved.
    prefix : str
        The path (:func:`logit_prefixes`).

    Returns
    -------
    xarray.Dataset
        A new dataset (not validated); tokens int32, the rest float32, with ``top`` = 0..k-1.

    Raises
    ------
    ValueError
        A prefix the kind does not have, or an array of the wrong rank.
    KeyError
        A field is missing.

    Examples
    --------
    >>> from protocols.examples import example_dataset
    >>> ds = example_dataset(docs=1, policies=1, replicates=2, horizon=3)
    >>> top = np.zeros((2, 3, 4))
    >>> arrays = {n: top if n in LOGIT_TOP else np.zeros((2, 3)) for n in LOGIT_FIELDS}
    >>> with_logits(ds, arrays)["p_top_logp"].dims
    ('doc', 'policy', 'replicate', 'step', 'top')
    """
    dims = logit_var_dims(ds.attrs.get("kind"))
    if prefix + LOGIT_FIELDS[0] not in dims:
        raise ValueError(f"kind {ds.attrs.get('kind')!r} has no logit path {prefix!r}")
    data = {}
    for name in LOGIT_FIELDS:
        full = prefix + name
        a = np.asarray(arrays[name])
        want = len(dims[full])
        if a.ndim == want - 2:
            a = a[None, None]
        if a.ndim != want:
            raise ValueError(f"{name}: expected {want} or {want - 2} dims {dims[full]}, got shape {a.shape}")
        dtype = _TOKEN_DTYPE if name in LOGIT_TOKENS else _PROB_DTYPE
        if name in LOGIT_TOKENS:
            a = np.where(np.isnan(a), -1, a) if a.dtype.kind == "f" else a
        text = FIELD_DOCS[name] + PATH_DOCS[prefix]
        data[full] = xr.Variable(dims[full], a.astype(dtype), attrs={"description": text})
    k = next(v.shape[-1] for n, v in data.items() if n.endswith("top_logp"))
    return ds.assign(data).assign_coords({TOP_DIM: np.arange(k, dtype=np.int32)})
