"""Bring your own traces (docs/contract.md §4): converters into ``kvdiv.trace/1``.

* :func:`from_probabilities` — per-step next-token laws of the two models along
  coupled histories → a ``coupled`` dataset (TV computed as 1 − Σ min(p, q)).
* :func:`residual_from_probabilities` — the same for residual-branch runs.
* :func:`from_eval_logs` — JSONL evaluation logs (text sampled from the full
  model with per-token log-probs under both models) → a ``reference`` dataset.
* :func:`from_openai_logprobs` — OpenAI-format responses (the full model's sampled
  text with ``logprobs.content``, the compressed model's log-probs of the same
  tokens) → a ``reference`` dataset, through :func:`from_eval_logs`.
* :func:`from_kvpress_results` — kvpress's evaluation output (a leaderboard's
  predictions per press and ratio) → an ``answers`` dataset, the no-press run as P;
  :func:`from_answer_rows` — the same from plain answer rows (JSONL)
  (``protocols.kvpress_results``).

Every converter validates its output. Errors name the input row: the array
index for array inputs, the 1-based line (or record) number for logs.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from protocols.errors import ConversionError

# The leaderboard converters live in their own module (CSV and config reading); re-exported here.
from protocols.kvpress_results import from_answer_rows, from_kvpress_results
from protocols.log_rows import log_rows
from protocols.schema import MISSING_TOKEN, coupled_dataset, eos_set, reference_dataset, residual_dataset
from protocols.validate import LOGP_ATOL, TraceValidationError, validate

__all__ = [
    "PROB_ATOL", "ConversionError", "from_answer_rows", "from_eval_logs", "from_kvpress_results",
    "from_openai_logprobs", "from_probabilities",
    "residual_from_probabilities", "tv_from_probabilities",
]

#: How far a probability row may sum away from 1.
PROB_ATOL = 1e-3




# ----------------------------------------------------------------------------- probabilities

def _lead4(name: str, a: Any, trailing: int) -> np.ndarray:
    """Accept (doc, policy, replicate, step[, vocab]) or (replicate, step[, vocab])."""
    a = np.asarray(a)
    if a.ndim == 2 + trailing:
        a = a[None, None]
    if a.ndim != 4 + trailing:
        raise ConversionError(f"{name}: expected (doc, policy, replicate, step{', vocab' * trailing}) or "
                              f"(replicate, step{', vocab' * trailing}), got shape {a.shape}")
    return a


def _row(name: str, idx: tuple[int, ...], axis: str = "step") -> str:
    labels = ("doc", "policy", "replicate", axis)
    # idx always has the four (doc, policy, replicate, step|age) entries: strict.
    parts = (f"{d}={i + (1 if d == 'step' else 0)}" for d, i in zip(labels, idx, strict=True))
    return f"{name}[" + ", ".join(parts) + "]"


def _first(mask: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(mask)), mask.shape))


def _check_probs(name: str, probs: np.ndarray, axis: str) -> np.ndarray:
    """Rows are probability vectors or all-NaN (unobserved); returns the 'observed' mask."""
    nan = np.isnan(probs)
    observed = ~nan.all(-1)
    partial = nan.any(-1) & observed
    if partial.any():
        raise ConversionError(f"{_row(name, _first(partial), axis)}: some entries are NaN (a row is all numbers "
                              "or all NaN for 'unobserved')")
    neg = observed & (np.nan_to_num(probs) < 0).any(-1)
    if neg.any():
        raise ConversionError(f"{_row(name, _first(neg), axis)}: negative probability")
    total = np.nansum(probs, axis=-1)
    off = observed & (np.abs(total - 1) > PROB_ATOL)
    if off.any():
        i = _first(off)
        raise ConversionError(f"{_row(name, i, axis)}: sums to {total[i]:.6g}, not 1 (tolerance {PROB_ATOL:g})")
    return observed


def tv_from_probabilities(p: Any, q: Any) -> np.ndarray:
    """TV(p, q) = 1 − Σ_v min(p_v, q_v) over the last axis, clipped to [0, 1]; all-NaN rows give NaN.

    Computed in float64 so that float32 inputs do not round a small TV to a
    negative number or to 0.

    Parameters
    ----------
    p, q : array_like
        Probability vectors along the last axis, of one shape.

    Returns
    -------
    numpy.ndarray
        The TV per row (shape without the last axis), float64.

    Raises
    ------
    ConversionError
        ``p`` and ``q`` have different shapes.

    Examples
    --------
    >>> tv_from_probabilities([0.5, 0.5, 0.0], [0.25, 0.25, 0.5])
    array(0.5)
    """
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    if p.shape != q.shape:
        raise ConversionError(f"p and q have different shapes {p.shape} and {q.shape}")
    # ½‖p − q‖₁ equals 1 − Σ min(p, q) for normalised rows and is the better-conditioned form.
    tv = np.clip(0.5 * np.abs(p - q).sum(-1), 0.0, 1.0)
    return np.where(np.isnan(p).all(-1) | np.isnan(q).all(-1), np.nan, tv)


def _token_prob(name: str, probs: np.ndarray, tokens: np.ndarray, axis: str) -> np.ndarray:
    """probs[..., token] where the token is observed; checks the token had positive probability."""
    V = probs.shape[-1]
    bad = (tokens != MISSING_TOKEN) & ((tokens < 0) | (tokens >= V))
    if bad.any():
        i = _first(bad)
        raise ConversionError(f"{_row(name, i, axis)} = {tokens[i]}: outside [0, {V})")
    safe = np.clip(tokens, 0, V - 1)[..., None]
    pr = np.take_along_axis(probs, safe, axis=-1)[..., 0]
    zero = (tokens != MISSING_TOKEN) & ~(pr > 0)
    if zero.any():
        i = _first(zero)
        raise ConversionError(f"{_row(name, i, axis)} = {tokens[i]} has probability {pr[i]} under the law "
                              "it was sampled from")
    return pr


def from_probabilities(
    p_probs: Any,
    q_probs: Any,
    x_token: Any,
    y_token: Any,
    *,
    logp: bool = True,
    **builder: Any,
) -> xr.Dataset:
    """A ``coupled`` dataset from both models' next-token laws along coupled histories.

    ``p_probs[..., t, :]`` is p_t(· | x_<t) (the reference model on the P history),
    ``q_probs[..., t, :]`` is q_t(· | y_<t) (the candidate on the Q history), both
    shaped (doc, policy, replicate, step, vocab) or (replicate, step, vocab) and
    *after* temperature / top-k / top-p; ``x_token`` / ``y_token`` are the tokens
    the coupling drew, shaped without the vocab axis. With ``logp`` the optional
    ``x_logp`` = log p_t(x_t) and ``y_logp`` = log q_t(y_t) are added. Other keywords
    go to :func:`protocols.schema.coupled_dataset` (``docs``, ``policies``,
    ``eos_token_id``, ``model``, ``sampling``, ...); ``vocab_size`` defaults to the
    vocab axis length.

    Parameters
    ----------
    p_probs, q_probs : array_like
        The two laws, (doc, policy, replicate, step, vocab) or (replicate, step, vocab).
    x_token, y_token : array_like
        The coupled tokens, shaped like the laws without the vocab axis.
    logp : bool, default True
        Add ``x_logp`` and ``y_logp``.
    **builder
        Keywords for :func:`protocols.schema.coupled_dataset`.

    Returns
    -------
    xarray.Dataset
        A validated ``coupled`` dataset.

    Raises
    ------
    ConversionError
        Shapes disagree, a row is not a probability vector (or is NaN: coupled
        trajectories are complete), or a token had probability 0 under its law;
        the message names the row.
    TraceValidationError
        The result breaks the contract (e.g. tokens differ at TV 0).

    Examples
    --------
    >>> p = [[[0.5, 0.5], [1.0, 0.0]]]          # (replicate, step, vocab)
    >>> q = [[[0.5, 0.5], [0.0, 1.0]]]
    >>> ds = from_probabilities(p, q, [[0, 0]], [[0, 1]])
    >>> ds.tv.values.ravel().tolist()
    [0.0, 1.0]
    """
    p = _lead4("p_probs", p_probs, 1)
    q = _lead4("q_probs", q_probs, 1)
    x = _lead4("x_token", x_token, 0)
    y = _lead4("y_token", y_token, 0)
    if p.shape != q.shape or p.shape[:-1] != x.shape or x.shape != y.shape:
        raise ConversionError(f"shapes disagree: p_probs {p.shape}, q_probs {q.shape}, x_token {x.shape}, "
                              f"y_token {y.shape}")
    for name, probs in (("p_probs", p), ("q_probs", q)):
        observed = _check_probs(name, probs, "step")
        if not observed.all():
            raise ConversionError(f"{_row(name, _first(~observed), 'step')}: all NaN, but coupled "
                                  "trajectories are complete (every step is observed)")
    builder.setdefault("vocab_size", p.shape[-1])
    if logp:
        with np.errstate(divide="ignore"):
            builder["x_logp"] = np.log(_token_prob("x_token", p, x, "step"))
            builder["y_logp"] = np.log(_token_prob("y_token", q, y, "step"))
    ds = coupled_dataset(tv_from_probabilities(p, q), x, y, **builder)
    return validate(ds, source="(from_probabilities)")


def residual_from_probabilities(
    shared_p: Any,
    shared_q: Any,
    shared_token: Any,
    branch_step: Any,
    branch_p: Any,
    branch_q: Any,
    branch_x_token: Any,
    branch_y_token: Any,
    **builder: Any,
) -> xr.Dataset:
    """A ``residual`` dataset from both models' laws on the survival path and on the branches.

    ``shared_p`` / ``shared_q``: (doc, policy, replicate, step, vocab) laws on the
    shared history z_<t, all-NaN rows after the path stopped; ``shared_token``:
    Z_t, −1 where none. ``branch_p`` / ``branch_q``: (…, age, vocab) laws of the P
    and Q branches at ages 0..T−1 (all-NaN where unobserved), ``branch_step`` = t*
    (0 for none) and the branch tokens (−1 where unobserved). Keywords go to
    :func:`protocols.schema.residual_dataset` (``window`` included).

    Parameters
    ----------
    shared_p, shared_q : array_like
        Laws on the survival path, (..., step, vocab).
    shared_token : array_like
        Z_t per step, -1 where none.
    branch_step : array_like
        t* per (doc, policy, replicate), 0 for none.
    branch_p, branch_q : array_like
        Laws of the two branches, (..., age, vocab).
    branch_x_token, branch_y_token : array_like
        Branch tokens per age, -1 where unobserved.
    **builder
        Keywords for :func:`protocols.schema.residual_dataset`.

    Returns
    -------
    xarray.Dataset
        A validated ``residual`` dataset.

    Raises
    ------
    ConversionError
        Shapes disagree or a row is neither a probability vector nor all NaN.
    TraceValidationError
        The result breaks the contract (e.g. masks that disagree with the window).

    Examples
    --------
    >>> import numpy as np
    >>> nan = [np.nan, np.nan]
    >>> ds = residual_from_probabilities(
    ...     [[[0.5, 0.5], [0.0, 1.0]]], [[[1.0, 0.0], [0.0, 1.0]]], [[0, 1]], [1],
    ...     [[[0.5, 0.5], nan]], [[[1.0, 0.0], nan]], [[1, -1]], [[0, -1]], window=0)
    >>> int(ds.branch_step.item()), float(ds.branch_tv[..., 0].item())
    (1, 0.5)
    """
    sp, sq = _lead4("shared_p", shared_p, 1), _lead4("shared_q", shared_q, 1)
    bp, bq = _lead4("branch_p", branch_p, 1), _lead4("branch_q", branch_q, 1)
    if sp.shape != sq.shape or bp.shape != bq.shape or sp.shape[:3] != bp.shape[:3]:
        raise ConversionError(f"shapes disagree: shared {sp.shape} / {sq.shape}, branch {bp.shape} / {bq.shape}")
    _check_probs("shared_p", sp, "step")
    _check_probs("shared_q", sq, "step")
    _check_probs("branch_p", bp, "age")
    _check_probs("branch_q", bq, "age")
    builder.setdefault("vocab_size", sp.shape[-1])
    ds = residual_dataset(tv_from_probabilities(sp, sq), shared_token, branch_step, tv_from_probabilities(bp, bq),
                          branch_x_token, branch_y_token, **builder)
    return validate(ds, source="(residual_from_probabilities)")


# ----------------------------------------------------------------------------- evaluation logs

def _parse_row(label: str, rec: Any) -> dict[str, Any]:
    if isinstance(rec, (str, bytes)):
        try:
            rec = json.loads(rec)      # accepts -Infinity for log q = -inf
        except ValueError as exc:
            raise ConversionError(f"{label}: not valid JSON ({exc})") from None
    if not isinstance(rec, Mapping):
        raise ConversionError(f"{label}: expected a JSON object, got {type(rec).__name__}")
    missing = [k for k in ("tokens", "logp_full", "logp_evicted") if k not in rec]
    if missing:
        raise ConversionError(f"{label}: missing field(s) {missing}")
    return dict(rec)


def _row_arrays(label: str, rec: dict[str, Any], V: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = {k: len(rec[k]) if isinstance(rec[k], list) else -1 for k in ("tokens", "logp_full", "logp_evicted")}
    if len(set(n.values())) != 1 or n["tokens"] < 1:
        raise ConversionError(f"{label}: tokens, logp_full and logp_evicted must be non-empty lists of one "
                              f"length, got lengths {n}")
    try:
        tok = np.array(rec["tokens"], dtype=np.float64)
        lp = np.array([math.nan if v is None else v for v in rec["logp_full"]], dtype=np.float64)
        lq = np.array([math.nan if v is None else v for v in rec["logp_evicted"]], dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ConversionError(f"{label}: non-numeric value ({exc})") from None
    checks = (
        (~np.isfinite(tok) | (tok != np.round(tok)) | (tok < 0) | (tok >= V), "tokens", f"not a token id in [0, {V})"),
        (~np.isfinite(lp), "logp_full", "not finite (the token was sampled from the full model)"),
        (lp > LOGP_ATOL, "logp_full", "> 0 (not a log-probability)"),
        (np.isnan(lq) | (lq == np.inf), "logp_evicted", "NaN, null or +inf (-Infinity is allowed: q = 0)"),
        (lq > LOGP_ATOL, "logp_evicted", "> 0 (not a log-probability)"),
    )
    for bad, field, what in checks:
        if bad.any():
            i = int(np.argmax(bad))
            value = rec[field][i]
            raise ConversionError(f"{label}: {field}[{i}] = {value!r} is {what}")
    return tok.astype(np.int64), lp, lq


def _fit(label: str, doc: str, arrays: tuple[np.ndarray, ...], T: int,
         eos: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """Cut a row to the horizon or pad a row that ended at EOS (EOS absorbing: the id it
    ended on, at log 1 = 0). ``eos`` holds every EOS id (empty: none)."""
    tok, lp, lq = (a[:T] for a in arrays)
    hits = np.flatnonzero(np.isin(tok, eos)) if eos else np.array([], dtype=np.int64)
    if hits.size:
        end = tok[hits[0]]
        if (tok[hits[0]:] != end).any():
            j = hits[0] + int(np.argmax(tok[hits[0]:] != end))
            raise ConversionError(f"{label} (doc {doc!r}): token {j} = {tok[j]} follows EOS {end} at token "
                                  f"{hits[0]}; EOS is absorbing (the same id)")
        after = np.zeros(tok.size, dtype=bool)
        after[hits[0] + 1:] = True
        if (lp[after] != 0).any() or (lq[after] != 0).any():
            raise ConversionError(f"{label} (doc {doc!r}): log-probs after EOS must be 0 (EOS is absorbing)")
    n = tok.size
    if n == T:
        return tok, lp, lq
    if not eos:
        raise ConversionError(f"{label} (doc {doc!r}): {n} tokens, fewer than the horizon {T}; a short row means "
                              "the text ended at EOS, so pass eos_token_id= (or horizon=) to pad it")
    if n == 0 or tok[-1] not in eos:
        last = tok[-1] if n else None
        raise ConversionError(f"{label} (doc {doc!r}): {n} tokens, fewer than the horizon {T}, and the last is "
                              f"{last}, not EOS {_eos_text(eos)}; only rows that ended at EOS can be padded")
    pad = T - n
    return (np.concatenate([tok, np.full(pad, tok[-1])]), np.concatenate([lp, np.zeros(pad)]),
            np.concatenate([lq, np.zeros(pad)]))


def _eos_text(eos: tuple[int, ...]) -> str:
    return str(eos[0]) if len(eos) == 1 else f"(one of {list(eos)})"


def from_eval_logs(
    source: str | os.PathLike[str] | Iterable[Mapping[str, Any] | str | bytes],
    *,
    vocab_size: int,
    eos_token_id: int | None = None,
    horizon: int | None = None,
    policy: str = "candidate",
    eos_token_ids: Sequence[int] | None = None,
    model: str = "",
    sampling: Mapping[str, Any] | str | None = None,
    producer: str = "eval logs (protocols.converters.from_eval_logs)",
) -> xr.Dataset:
    """A ``reference`` dataset from evaluation logs (docs/statistics.md §7).

    ``source`` is a JSONL path, an iterable of JSON lines or of dicts. Each row
    holds ``tokens`` (sampled from the full model), ``logp_full`` (log p of each
    token under the full model) and ``logp_evicted`` (log q under the evicted one;
    ``-Infinity`` allowed), plus optional ``doc`` (or ``id``), ``policy`` (default
    ``policy``), ``replicate`` (default: order within its doc and policy),
    ``split`` and ``prompt_tokens``. Rows without a doc id are documents of their
    own, named ``row<N>``.

    The horizon defaults to the longest row. Longer rows are cut to it; shorter
    rows must end with ``eos_token_id`` and are padded with EOS at log p = log q = 0
    (the absorbing point mass). Errors name the row; the dataset gets a
    ``source_row`` coordinate (doc, policy, replicate) with each row's number.

    Parameters
    ----------
    source : path or iterable of str, bytes or mappings
        The JSONL file, or its lines, or decoded rows.
    vocab_size : int
        The vocabulary size (token ids must lie in ``[0, vocab_size)``).
    eos_token_id : int, optional
        The EOS token; needed to pad rows shorter than the horizon.
    eos_token_ids : sequence of int, optional
        Every EOS id, for a model with several (``eos_token_id`` then defaults
        to the first); a row ending at any of them is padded with that id.
    horizon : int, optional
        T; default the longest row.
    policy : str, default "candidate"
        Policy id for rows without a ``policy`` field.
    model, sampling, producer : optional
        Attributes of the dataset.

    Returns
    -------
    xarray.Dataset
        A validated ``reference`` dataset with a ``source_row`` coordinate.

    Raises
    ------
    FileNotFoundError
        ``source`` is a path that does not exist.
    ConversionError
        A row that is not JSON, lacks a field, holds a bad value, is short without
        ending at EOS, repeats a replicate, or leaves a doc without a policy.
    TraceValidationError
        The result breaks the contract; each problem names its input row.

    Examples
    --------
    >>> rows = ['{"doc": "d0", "tokens": [3, 1], "logp_full": [-0.1, -0.2], "logp_evicted": [-0.3, -Infinity]}']
    >>> ds = from_eval_logs(rows, vocab_size=4)
    >>> ds.attrs["kind"], ds.x_logq.values.ravel().tolist()
    ('reference', [-0.30000001192092896, -inf])
    """
    try:
        eos = eos_set(eos_token_id, eos_token_ids)
    except ValueError as exc:
        raise ConversionError(str(exc)) from None
    rows = []
    for label, raw in log_rows(source):
        rec = _parse_row(label, raw)
        doc = rec.get("doc", rec.get("id"))
        doc = f"row{label.split()[-1]}" if doc is None else str(doc)
        rows.append((label, doc, str(rec.get("policy", policy)), rec.get("replicate"),
                     _row_arrays(label, rec, vocab_size), rec))
    if not rows:
        raise ConversionError("no rows in the evaluation log")
    T = horizon if horizon is not None else max(r[4][0].size for r in rows)
    return _build_reference(rows, T, eos, vocab_size=vocab_size, eos_token_id=eos_token_id,
                            eos_token_ids=eos_token_ids, model=model, sampling=sampling, producer=producer)


def _build_reference(rows: list[tuple], T: int, eos: tuple[int, ...], **kw: Any) -> xr.Dataset:
    docs = list(dict.fromkeys(r[1] for r in rows))
    pols = list(dict.fromkeys(r[2] for r in rows))
    groups: dict[tuple[str, str], dict[int, tuple]] = {}
    doc_meta: dict[str, dict[str, Any]] = {}
    for label, doc, pol, rep, arrays, rec in rows:
        cell = groups.setdefault((doc, pol), {})
        r = len(cell) if rep is None else rep
        if not isinstance(r, int) or r < 0:
            raise ConversionError(f"{label}: replicate {rep!r} is not an integer >= 0")
        if r in cell:
            raise ConversionError(f"{label}: doc {doc!r}, policy {pol!r}, replicate {r} already given by "
                                  f"{cell[r][0]}")
        cell[r] = (label, _fit(label, doc, arrays, T, eos))
        meta = doc_meta.setdefault(doc, {"split": rec.get("split", ""), "prompt_tokens": rec.get("prompt_tokens", 0),
                                          "label": label})
        for key in ("split", "prompt_tokens"):
            if key in rec and rec[key] != meta[key]:
                raise ConversionError(f"{label}: doc {doc!r} has {key} {rec[key]!r}, but {meta['label']} "
                                      f"gave {meta[key]!r}")
    R = max(len(c) for c in groups.values())
    shape = (len(docs), len(pols), R, T)
    tok, lp, lq = np.zeros(shape, np.int64), np.zeros(shape), np.zeros(shape)
    src = np.zeros(shape[:3], np.int32)
    for d, doc in enumerate(docs):
        for p, pol in enumerate(pols):
            cell = groups.get((doc, pol))
            if cell is None:
                raise ConversionError(f"doc {doc!r} has no rows for policy {pol!r}; every doc needs every policy")
            if sorted(cell) != list(range(R)):
                raise ConversionError(f"doc {doc!r}, policy {pol!r}: replicates {sorted(cell)}, expected 0..{R - 1} "
                                      f"(first row: {min(c[0] for c in cell.values())})")
            for r, (label, (t, a, b)) in cell.items():
                tok[d, p, r], lp[d, p, r], lq[d, p, r] = t, a, b
                src[d, p, r] = int(label.split()[-1])
    ds = reference_dataset(tok, lp, lq, docs=docs, policies=pols,
                           split=[doc_meta[d]["split"] for d in docs],
                           prompt_tokens=[doc_meta[d]["prompt_tokens"] for d in docs], **kw)
    ds = ds.assign_coords(source_row=(("doc", "policy", "replicate"), src))
    ds.source_row.attrs["description"] = "1-based line (or record) number of the input row"
    return _validate_naming_rows(ds)


def _validate_naming_rows(ds: xr.Dataset) -> xr.Dataset:
    """Validate; problems located at a (doc, policy, replicate) get the input row appended."""
    try:
        return validate(ds, source="(from_eval_logs)")
    except TraceValidationError as err:
        named = []
        for p in err.problems:
            where = getattr(p, "where", {})
            if {"doc", "policy", "replicate"} <= where.keys():
                row = ds.source_row.sel(doc=where["doc"], policy=where["policy"], replicate=where["replicate"])
                p = f"{p} (input row {int(row)})"
            named.append(p)
        raise TraceValidationError(named, source="(from_eval_logs)") from None


# ----------------------------------------------------------------------------- OpenAI-format responses

#: vLLM's ``return_tokens_as_token_ids`` spelling of a token: ``"token_id:<id>"``.
_TOKEN_ID_PREFIX = "token_id:"


def _content(where: str, item: Any) -> list[Any]:
    """``logprobs.content`` of a chat completion, of one choice, or the list itself."""
    if isinstance(item, Mapping) and "choices" in item:
        choices = item["choices"]
        if not isinstance(choices, list) or len(choices) != 1:
            raise ConversionError(f"{where}: expected a response with exactly one choice (n = 1)")
        item = choices[0]
    if isinstance(item, Mapping):
        lp = item.get("logprobs")
        if not isinstance(lp, Mapping) or not isinstance(lp.get("content"), list):
            raise ConversionError(f"{where}: no logprobs.content (ask the server for logprobs: true)")
        item = lp["content"]
    if not isinstance(item, list) or not item:
        raise ConversionError(f"{where}: expected a response, a choice or a non-empty logprobs.content list")
    return item


def _finish(item: Any) -> str | None:
    if isinstance(item, Mapping) and "choices" in item and isinstance(item["choices"], list) and item["choices"]:
        item = item["choices"][0]
    return item.get("finish_reason") if isinstance(item, Mapping) else None


def _logprob(where: str, i: int, entry: Any) -> float:
    value = entry.get("logprob") if isinstance(entry, Mapping) else entry
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConversionError(f"{where}: logprobs.content[{i}] has no numeric logprob ({entry!r})")
    return float(value)


def _token_id(where: str, i: int, token: Any, token_ids: Mapping[str, int] | Any | None) -> int:
    if isinstance(token, str) and token.startswith(_TOKEN_ID_PREFIX) and token[len(_TOKEN_ID_PREFIX):].isdigit():
        return int(token[len(_TOKEN_ID_PREFIX):])
    if token_ids is None:
        raise ConversionError(f"{where}: logprobs.content[{i}].token = {token!r} is text, not an id; pass "
                              "token_ids= (a mapping or a callable token -> id), or ask the server for ids "
                              "(vLLM: return_tokens_as_token_ids)")
    try:
        tid = token_ids[token] if isinstance(token_ids, Mapping) else token_ids(token)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConversionError(f"{where}: logprobs.content[{i}].token = {token!r} has no id in token_ids "
                              f"({type(exc).__name__}: {exc})") from None
    if isinstance(tid, bool) or not isinstance(tid, (int, np.integer)):
        raise ConversionError(f"{where}: token_ids gave {tid!r} for {token!r}, not an integer id")
    return int(tid)


def _scores_for(policy: str, by_doc: Any, doc: str, n: int) -> Sequence[Any]:
    """``scores[policy][doc]``: one score per sample of the doc."""
    if not isinstance(by_doc, Mapping) or doc not in by_doc:
        raise ConversionError(f"scores[{policy!r}]: no scores for doc {doc!r}; every policy scores every sample")
    given = by_doc[doc]
    if isinstance(given, (str, bytes, Mapping)) or not isinstance(given, Sequence) or len(given) != n:
        got = len(given) if isinstance(given, Sequence) else "no list of"
        raise ConversionError(f"scores[{policy!r}][{doc!r}]: {got} scores for {n} samples")
    return given


def _score_row(where: str, scored: Any, tokens: list[Any]) -> list[float]:
    """The compressed model's log-probabilities of a sample's tokens (numbers, or entries whose tokens match)."""
    numbers = isinstance(scored, Sequence) and bool(scored) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in scored)
    entries = list(scored) if numbers else _content(where, scored)
    if len(entries) < len(tokens):
        raise ConversionError(f"{where}: {len(entries)} log-probabilities for the sample's {len(tokens)} tokens")
    for i, e in enumerate(entries[: len(tokens)]):
        if isinstance(e, Mapping) and "token" in e and e["token"] != tokens[i]:
            raise ConversionError(f"{where}: token {i} is {e['token']!r}, the sample's is {tokens[i]!r}; "
                                  "a score must be of the sample's own tokens")
    return [_logprob(where, i, e) for i, e in enumerate(entries[: len(tokens)])]


def from_openai_logprobs(
    samples: Mapping[str, Sequence[Any]],
    scores: Mapping[str, Mapping[str, Sequence[Any]]],
    *,
    vocab_size: int,
    token_ids: Mapping[str, int] | Any | None = None,
    eos_token_id: int | None = None,
    eos_token_ids: Sequence[int] | None = None,
    horizon: int | None = None,
    model: str = "",
    sampling: Mapping[str, Any] | str | None = None,
    producer: str = "OpenAI-format responses (protocols.converters.from_openai_logprobs)",
) -> xr.Dataset:
    """A ``reference`` dataset from OpenAI-format responses (docs/contract.md §4, statistics.md §7).

    ``samples[doc]`` holds the full model's sampled responses for a document (one
    replicate each): chat completions, their single choice, or their
    ``logprobs.content`` lists, as vLLM, SGLang and kvdiv's Messages API return them
    with ``logprobs: true``. ``scores[policy][doc]`` holds, in the same order, the
    compressed model's log-probabilities of the same tokens: a response or content
    list (its tokens must equal the sample's) or a plain list of numbers. Every
    policy scores the same samples, so the dataset is paired across policies.

    The replay caveat: a score obtained by teacher forcing (prompt log-probabilities
    of prompt + continuation, ``echo``) is the compressed model's law only if the
    compression of that scoring pass is the one decoding would have had; a press
    that compresses the prompt alone and leaves decode-time tokens uncompressed must
    be told which tokens are the prompt.

    Parameters
    ----------
    samples : mapping of str to sequence
        doc -> the full model's responses, one per replicate.
    scores : mapping of str to mapping of str to sequence
        policy -> doc -> the compressed model's log-probabilities of each sample's tokens.
    vocab_size : int
        The vocabulary size.
    token_ids : mapping or callable, optional
        Token text -> id (e.g. a tokenizer's vocabulary); not needed when the tokens
        are spelled ``"token_id:<id>"`` (vLLM's ``return_tokens_as_token_ids``).
    eos_token_id, eos_token_ids : optional
        The EOS id(s). A response shorter than the horizon must end with one (kvdiv's
        server includes the EOS token in ``logprobs.content``); it is padded with EOS
        at log p = log q = 0.
    horizon : int, optional
        T; default the longest sample. Longer samples are cut to it.
    model, sampling, producer : optional
        Attributes of the dataset.

    Returns
    -------
    xarray.Dataset
        A validated ``reference`` dataset over (doc, policy, replicate, step).

    Raises
    ------
    ConversionError
        A response without ``logprobs.content``, a token without an id, a score whose
        tokens or length differ from its sample's, a doc missing from a policy's
        scores, or a bad value (named as policy, doc and replicate).

    Examples
    --------
    >>> sample = {"choices": [{"finish_reason": "length", "logprobs": {"content": [
    ...     {"token": "token_id:3", "logprob": -0.1}, {"token": "token_id:1", "logprob": -0.2}]}}]}
    >>> ds = from_openai_logprobs({"d0": [sample]}, {"snapkv@0.5": {"d0": [[-0.5, -0.25]]}}, vocab_size=4)
    >>> ds.x_token.values.ravel().tolist(), ds.x_logq.values.ravel().tolist()
    ([3, 1], [-0.5, -0.25])
    """
    if not isinstance(samples, Mapping) or not samples:
        raise ConversionError("samples: expected a non-empty mapping doc -> the full model's responses")
    if not isinstance(scores, Mapping) or not scores:
        raise ConversionError("scores: expected a non-empty mapping policy -> doc -> the compressed model's scores")
    records: list[dict[str, Any]] = []
    where_of: list[str] = []
    for doc, responses in samples.items():
        if isinstance(responses, (str, bytes, Mapping)) or not isinstance(responses, Sequence) or not responses:
            raise ConversionError(f"samples[{doc!r}]: expected a non-empty list of responses (one per replicate)")
        for r, response in enumerate(responses):
            where = f"samples[{doc!r}][{r}]"
            content = _content(where, response)
            tokens = [e.get("token") if isinstance(e, Mapping) else None for e in content]
            ids = [_token_id(where, i, t, token_ids) for i, t in enumerate(tokens)]
            logp = [_logprob(where, i, e) for i, e in enumerate(content)]
            if _finish(response) == "stop" and eos_token_id is None and not eos_token_ids:
                raise ConversionError(f"{where}: finish_reason 'stop' (the text ended), so pass eos_token_id= "
                                      "to mark where the path ends")
            for policy, by_doc in scores.items():
                swhere = f"scores[{policy!r}][{doc!r}][{r}]"
                scored = _scores_for(policy, by_doc, doc, len(responses))[r]
                logq = _score_row(swhere, scored, tokens)
                records.append({"doc": str(doc), "policy": str(policy), "replicate": r, "tokens": ids,
                                "logp_full": logp, "logp_evicted": logq})
                where_of.append(swhere)
    try:
        return from_eval_logs(records, vocab_size=vocab_size, eos_token_id=eos_token_id, eos_token_ids=eos_token_ids,
                              horizon=horizon, model=model, sampling=sampling, producer=producer)
    except ConversionError as exc:
        # from_eval_logs names 'record N': name the response it came from instead
        msg = str(exc)
        for n in range(len(records), 0, -1):
            msg = msg.replace(f"record {n}", where_of[n - 1].replace("scores", "sample scored by", 1))
        raise ConversionError(msg) from None


