"""Wire stream → dataset (docs/contract.md §3): :func:`assemble` one request's lines.

The lines are read once by :class:`protocols.stream.StreamReader` (limits, digest,
order, shapes), then every per-step array is stacked once with numpy, so a
64-replicate × 512-step stream costs little beyond ``json.loads``.

Header fields become attrs and coordinates of the one-doc, one-policy dataset:

=====================  =========================================================
header                 dataset
=====================  =========================================================
schema, kind, horizon,  attrs of the same names (``coupling`` is always
window, vocab_size,     ``stepwise-maximal``)
model, eos_token_id
eos_token_ids (list)    attr ``eos_token_ids`` when it holds more than one id
                        (``eos_token_id`` is then its first; absent: the one id)
sampling (object)       attr ``sampling`` (JSON, sorted keys)
producer (optional)     attr ``producer`` (default ``"kvdiv.trace/1 stream"``)
reference.policy        attr ``reference_policy``
prompt_template         attr ``prompt_template`` (only if the header has it)
doc / request_id        ``doc`` coordinate (the ``doc`` argument wins)
prompt_tokens           per-doc coord ``prompt_tokens``
candidate               ``policy`` coordinate and per-policy ``press``,
                        ``retention``, ``budget``
retained_tokens         per-(doc, policy) coord ``retained_tokens`` (int32)
seed                    per-(doc, policy) coord ``seed`` (int64, -1 when null)
request_id              per-(doc, policy) coord ``request_id`` (str)
end.elapsed_s           per-(doc, policy) coord ``elapsed_s`` (float64)
end.sha256              per-(doc, policy) coord ``stream_sha256`` (str)
prompt_sha256           key ``prompt_sha256`` of ``header_extra`` (when not null)
coupling (optional)     checked to be ``stepwise-maximal``
other header keys and   per-(doc, policy) coord ``header_extra``: JSON object
other candidate keys    (sorted keys; candidate leftovers under "candidate")
=====================  =========================================================
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import xarray as xr

from protocols.kinds import Kind
from protocols.logit_fields import LOGIT_FIELDS, LOGIT_TOP, WIRE_KEY, decode_rows, with_logits
from protocols.policies import policy_coords
from protocols.schema import (
    MISSING_TOKEN,
    PROB_DTYPE,
    REQUIRED_VARS,
    TOKEN_DTYPE,
    coupled_dataset,
    reference_dataset,
    residual_dataset,
)
from protocols.stream import Stream, StreamError, read_stream
from protocols.validate import validate

__all__ = ["StreamError", "assemble", "assemble_stream"]

_KNOWN_HEADER = {
    "type", "schema", "kind", "horizon", "window", "model", "eos_token_id", "eos_token_ids", "sampling", "reference",
    "candidate", "seed", "prompt_tokens", "retained_tokens", "replicates", "vocab_size", "doc",
    "request_id", "producer", "prompt_template", "coupling", "prompt_sha256", "top_logprobs",
}
_KNOWN_CANDIDATE = {"policy", "press", "retention", "budget"}
_INT32 = (-(2**31), 2**31 - 1)


def _floats(rows: list[list[Any]]) -> np.ndarray:
    # None -> NaN via float conversion; one numpy call for the whole stream.
    try:
        return np.array(rows, dtype=np.float64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise StreamError(f"non-numeric value in a record array ({exc})") from None


def _tokens(rows: list[list[Any]]) -> np.ndarray:
    a = _floats(rows)
    if np.any(np.isfinite(a) & (a != np.round(a))):
        raise StreamError("a token value is not an integer")
    if np.any(np.isinf(a) | (np.abs(np.nan_to_num(a)) > _INT32[1])):
        raise StreamError("a token value does not fit int32")
    return np.where(np.isnan(a), MISSING_TOKEN, a).astype(TOKEN_DTYPE)


def _as_int(value: Any, what: str, default: int, lo: int = _INT32[0], hi: int = _INT32[1]) -> int:
    """A header integer that must fit its dataset dtype (None -> default)."""
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise StreamError(f"header: {what} = {value!r} is not an integer in {lo}..{hi}")
    return value


def _eos_ids(value: Any, eos: int | None) -> list[int] | None:
    """The header's ``eos_token_ids`` (every EOS id), checked against ``eos_token_id``."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise StreamError(f"header: eos_token_ids = {value!r} is not a list of token ids")
    ids = [_as_int(v, "eos_token_ids[]", 0, 0) for v in value]
    if eos is not None and eos >= 0 and eos not in ids:
        raise StreamError(f"header: eos_token_id {eos} is not one of eos_token_ids {ids}")
    if not ids and eos is not None and eos >= 0:
        raise StreamError(f"header: eos_token_ids is empty but eos_token_id is {eos}")
    return ids


def _as_float(value: Any, what: str) -> float:
    if value is None:
        return math.nan
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise StreamError(f"header: {what} = {value!r} is not a number")
    return float(value)


def _coupled_arrays(records: tuple[dict[str, Any], ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # (replicate, step) arrays: the wire carries (step, replicate).
    tv = _floats([r["tv"] for r in records]).T.astype(PROB_DTYPE)
    return tv, _tokens([r["x_token"] for r in records]).T, _tokens([r["y_token"] for r in records]).T


def _branches(records: tuple[dict[str, Any], ...], T: int, W: int, R: int) -> dict[str, np.ndarray]:
    """The (already checked) branch records as (replicate, age) arrays."""
    bstep = np.zeros(R, dtype=TOKEN_DTYPE)
    btv = np.full((R, T), np.nan, dtype=PROB_DTYPE)
    bx = np.full((R, T), MISSING_TOKEN, dtype=TOKEN_DTYPE)
    by = np.full((R, T), MISSING_TOKEN, dtype=TOKEN_DTYPE)
    for rec in records:
        r, t_star = rec["replicate"], rec["branch_step"]
        n = min(W, T - t_star) + 1
        bstep[r] = t_star
        btv[r, :n] = _floats([rec["tv"]])[0]
        bx[r, :n], by[r, :n] = _tokens([rec["x_token"], rec["y_token"]])
    return {"branch_step": bstep, "branch_tv": btv, "branch_x_token": bx, "branch_y_token": by}


def _reference(records: tuple[dict[str, Any], ...], kwargs: dict[str, Any]) -> xr.Dataset:
    """The reference records as a dataset with its optional ``tv``; a null log q is -inf
    (q gave the sampled token no mass), a null log p stays NaN for validation to name."""
    logq = _floats([r["x_logq"] for r in records]).T
    ds = reference_dataset(_tokens([r["x_token"] for r in records]).T,
                           _floats([r["x_logp"] for r in records]).T.astype(PROB_DTYPE),
                           np.where(np.isnan(logq), -np.inf, logq).astype(PROB_DTYPE), **kwargs)
    tv = _floats([r["tv"] for r in records]).T.astype(PROB_DTYPE)
    return ds.assign(tv=(REQUIRED_VARS["reference"]["x_token"], tv[None, None]))


def _step_logits(records: tuple[dict[str, Any], ...], R: int, k: int) -> dict[str, np.ndarray]:
    """The step records' logit fields as (replicate, step[, top]) arrays."""
    rows = decode_rows([r[WIRE_KEY] for r in records], R, k)
    return {name: np.moveaxis(a, 0, 1) for name, a in rows.items()}


def _branch_logits(records: tuple[dict[str, Any], ...], T: int, W: int, R: int, k: int) -> dict[str, np.ndarray]:
    """The branch records' logit fields as (replicate, age[, top]) arrays, NaN where unobserved."""
    out = {name: np.full((R, T, k) if name in LOGIT_TOP else (R, T), np.nan) for name in LOGIT_FIELDS}
    for rec in records:
        n = min(W, T - rec["branch_step"]) + 1
        for name, a in decode_rows([rec[WIRE_KEY]], n, k).items():
            out[name][rec["replicate"], :n] = a[0]
    return out


def _meta(h: dict[str, Any], doc: str | None, end: dict[str, Any]) -> dict[str, Any]:
    """Builder keyword arguments and extra coords from the header."""
    cand = h["candidate"]
    policy = str(cand["policy"])
    press, retention, budget = policy_coords(policy)
    doc_id = doc if doc is not None else (h.get("doc") or h.get("request_id"))
    if not doc_id:
        raise StreamError("no document id: pass doc=..., or the header needs 'doc' or 'request_id'")
    ret = _as_float(cand.get("retention", retention), "candidate.retention")
    bud = _as_int(cand.get("budget", budget), "candidate.budget", -1)
    # Per-request leftovers (e.g. the service's reference_retained_tokens, press params)
    # go to a (doc, policy) coordinate, so combining requests keeps them.
    extra = {k: v for k, v in h.items() if k not in _KNOWN_HEADER}
    if h.get("prompt_sha256") is not None:  # kept losslessly without a new dataset variable
        extra["prompt_sha256"] = h["prompt_sha256"]
    cand_extra = {k: v for k, v in cand.items() if k not in _KNOWN_CANDIDATE}
    if cand_extra:
        extra["candidate"] = cand_extra
    attrs = {"reference_policy": str((h.get("reference") or {}).get("policy", "full"))}
    if h.get("prompt_template") is not None:
        attrs["prompt_template"] = str(h["prompt_template"])
    kwargs = dict(
        vocab_size=int(h["vocab_size"]), docs=[str(doc_id)], policies=[policy],
        eos_token_id=h.get("eos_token_id"), model=str(h.get("model", "")), sampling=h.get("sampling") or {},
        producer=str(h.get("producer") or "kvdiv.trace/1 stream"),
        prompt_tokens=[_as_int(h.get("prompt_tokens"), "prompt_tokens", 0, 0)],
        press=[str(cand.get("press") or press)],
        retention=[ret], budget=[bud], attrs=attrs,
    )
    eos = h.get("eos_token_id")
    kwargs["eos_token_id"] = None if eos is None else _as_int(eos, "eos_token_id", -1)
    kwargs["eos_token_ids"] = _eos_ids(h.get("eos_token_ids"), kwargs["eos_token_id"])
    seed = _as_int(h.get("seed"), "seed", -1, -1, 2**63 - 1)
    retained = _as_int(h.get("retained_tokens"), "retained_tokens", 0, 0)
    coords = {
        "retained_tokens": (("doc", "policy"), np.array([[retained]], dtype=np.int32)),
        "seed": (("doc", "policy"), np.array([[seed]], dtype=np.int64)),
        "request_id": (("doc", "policy"), np.array([[str(h.get("request_id") or "")]], dtype=object)),
        "elapsed_s": (("doc", "policy"), np.array([[_as_float(end.get("elapsed_s") or 0.0, "end.elapsed_s")]])),
        "stream_sha256": (("doc", "policy"), np.array([[str(end["sha256"])]], dtype=object)),
        "header_extra": (("doc", "policy"), np.array([[json.dumps(extra, sort_keys=True, default=str)]],
                                                     dtype=object)),
    }
    return {"kwargs": kwargs, "coords": coords}


def assemble(lines: Iterable[str | bytes] | str | bytes, doc: str | None = None) -> xr.Dataset:
    """Turn one request's wire lines into a validated dataset with one doc and one policy.

    Parameters
    ----------
    lines : iterable of str or bytes, or one str or bytes blob
        The stream's lines, with or without their trailing newline, or the whole
        body; SSE framing (``data: {...}`` events separated by blank lines) is
        accepted too.
    doc : str, optional
        The document id; defaults to the header's ``doc`` (or ``request_id``).

    Returns
    -------
    xarray.Dataset
        One doc, one policy, validated against the contract.

    Raises
    ------
    StreamError
        A truncated stream (no ``end``), an ``error`` record, a digest mismatch,
        records out of order, arrays of the wrong length, a line beyond the reader's
        limits, or header values that do not fit the dataset.
    TraceValidationError
        If the numbers break the contract.

    Examples
    --------
    >>> from protocols.examples import example_dataset
    >>> from protocols.wire import dataset_lines
    >>> assemble(dataset_lines(example_dataset(docs=1, policies=1, horizon=4))).sizes["step"]
    4
    """
    return assemble_stream(read_stream(lines), doc=doc)


def assemble_stream(stream: Stream, doc: str | None = None) -> xr.Dataset:
    """Build the validated one-doc, one-policy dataset of a stream already read by :class:`StreamReader`.

    Parameters
    ----------
    stream : Stream
        From :func:`protocols.read_stream` or :meth:`StreamReader.finish`.
    doc : str, optional
        The document id; defaults to the header's ``doc`` (or ``request_id``).

    Returns
    -------
    xarray.Dataset
        As :func:`assemble`.

    Raises
    ------
    StreamError, TraceValidationError
        As :func:`assemble` (the digest, order and shapes were checked by the reader).

    Examples
    --------
    >>> from protocols.examples import example_dataset
    >>> from protocols.stream import read_stream
    >>> from protocols.wire import dataset_lines
    >>> stream = read_stream(dataset_lines(example_dataset("residual", docs=1, policies=1, horizon=4)))
    >>> assemble_stream(stream, doc="d").doc.item()
    'd'
    """
    h, records = stream.header, stream.records
    T, R, W = h["horizon"], h["replicates"], h["window"]
    k = int(h.get("top_logprobs") or 0)
    meta = _meta(h, doc, stream.end)
    if h["kind"] == Kind.COUPLED:
        ds = coupled_dataset(*_coupled_arrays(records), **meta["kwargs"])
        if k:
            ds = with_logits(ds, _step_logits(records, R, k))
    elif h["kind"] == Kind.REFERENCE:
        ds = _reference(records, meta["kwargs"])
        if k:
            ds = with_logits(ds, _step_logits(records, R, k))
    else:
        shared, branches = records[:T], records[T:]
        br = _branches(branches, T, W, R)
        ds = residual_dataset(
            _floats([r["tv"] for r in shared]).T.astype(PROB_DTYPE), _tokens([r["token"] for r in shared]).T,
            br["branch_step"], br["branch_tv"], br["branch_x_token"], br["branch_y_token"], window=W,
            **meta["kwargs"])
        if k:
            ds = with_logits(ds, _step_logits(shared, R, k), "shared_")
            ds = with_logits(ds, _branch_logits(branches, T, W, R, k), "branch_")
    ds = ds.assign_coords(meta["coords"])
    return validate(ds, source=f"(assembled stream, request {h.get('request_id')!r})")
