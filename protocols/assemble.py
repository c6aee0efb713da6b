"""Wire stream → dataset (docs/contract.md §3): :func:`assemble` one request's lines.

The records are parsed one line at a time (the digest has to be), then every
per-step array is stacked once with numpy, so a 64-replicate × 512-step stream
costs little beyond ``json.loads``.

Header fields become attrs and coordinates of the one-doc, one-policy dataset:

=====================  =========================================================
header                 dataset
=====================  =========================================================
schema, kind, horizon,  attrs of the same names (``coupling`` is always
window, vocab_size,     ``stepwise-maximal``)
model, eos_token_id
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
coupling (optional)     checked to be ``stepwise-maximal``
other header keys and   per-(doc, policy) coord ``header_extra``: JSON object
other candidate keys    (sorted keys; candidate leftovers under "candidate")
=====================  =========================================================
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import xarray as xr

from protocols.errors import ProtocolError
from protocols.policies import policy_coords
from protocols.schema import COUPLING, MISSING_TOKEN, PROB_DTYPE, SCHEMA, TOKEN_DTYPE, coupled_dataset, residual_dataset
from protocols.validate import validate

__all__ = ["StreamError", "assemble"]

_KNOWN_HEADER = {
    "type", "schema", "kind", "horizon", "window", "model", "eos_token_id", "sampling", "reference",
    "candidate", "seed", "prompt_tokens", "retained_tokens", "replicates", "vocab_size", "doc",
    "request_id", "producer", "prompt_template", "coupling",
}
_KNOWN_CANDIDATE = {"policy", "press", "retention", "budget"}


class StreamError(ProtocolError, ValueError):
    """A wire stream that is incomplete, altered, failed or malformed."""


def _split(lines: Iterable[str | bytes] | str | bytes) -> list[bytes]:
    """Exact line bytes without their newline; a whole body may be passed as one blob."""
    if isinstance(lines, (str, bytes)):
        blob = lines.encode("utf-8") if isinstance(lines, str) else lines
        parts = blob.split(b"\n")
    else:
        parts = []
        for line in lines:
            b = line.encode("utf-8") if isinstance(line, str) else bytes(line)
            # Strip exactly one terminating newline: the digest re-adds it.
            parts.append(b[:-1] if b.endswith(b"\n") else b)
    return [line for line in map(_unsse, parts) if line]


def _unsse(line: bytes) -> bytes:
    """SSE framing (``data: <record>``) -> the NDJSON line the digest covers; other SSE fields dropped."""
    if line.startswith(b"data:"):
        line = line[5:]
        return line[1:] if line.startswith(b" ") else line
    if line.startswith((b":", b"event:", b"id:", b"retry:")):
        return b""
    return line


def _parse(raw: list[bytes]) -> tuple[list[dict[str, Any]], list[str]]:
    """Records and the running hex digest *before* each line (digest[i] covers lines < i)."""
    h = hashlib.sha256()
    records, digests = [], []
    for n, line in enumerate(raw, start=1):
        digests.append(h.hexdigest())
        try:
            rec = json.loads(line)
        except (ValueError, UnicodeDecodeError) as exc:
            raise StreamError(f"line {n}: not a JSON record ({exc}); truncated or corrupted stream") from None
        if not isinstance(rec, dict) or "type" not in rec:
            raise StreamError(f"line {n}: record without a 'type' field")
        if rec["type"] == "error":
            raise StreamError(f"line {n}: stream ended with an error record: "
                              f"{rec.get('error_type', '?')}: {rec.get('error', '')}")
        records.append(rec)
        h.update(line + b"\n")
    return records, digests


def _arr(rec: dict[str, Any], key: str, n: int, where: str) -> list[Any]:
    vals = rec.get(key)
    if not isinstance(vals, list) or len(vals) != n:
        got = len(vals) if isinstance(vals, list) else type(vals).__name__
        raise StreamError(f"{where}: '{key}' must be a list of length {n}, got {got}")
    return vals


def _floats(rows: list[list[Any]]) -> np.ndarray:
    # None -> NaN via float conversion; one numpy call for the whole stream.
    try:
        return np.array(rows, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise StreamError(f"non-numeric value in a record array ({exc})") from None


def _tokens(rows: list[list[Any]]) -> np.ndarray:
    a = _floats(rows)
    if np.any(np.isfinite(a) & (a != np.round(a))):
        raise StreamError("a token value is not an integer")
    return np.where(np.isnan(a), MISSING_TOKEN, a).astype(TOKEN_DTYPE)


def _header(rec: dict[str, Any]) -> dict[str, Any]:
    if rec.get("type") != "header":
        raise StreamError(f"line 1: expected a 'header' record first, got {rec.get('type')!r}")
    if rec.get("schema") != SCHEMA:
        raise StreamError(f"header: schema {rec.get('schema')!r} is not {SCHEMA!r}")
    if rec.get("kind") not in ("coupled", "residual"):
        raise StreamError(f"header: kind {rec.get('kind')!r} has no wire format (coupled or residual)")
    for key in ("horizon", "replicates", "vocab_size", "window"):
        if not isinstance(rec.get(key), int) or rec[key] < (0 if key == "window" else 1):
            raise StreamError(f"header: {key!r} = {rec.get(key)!r} is not a valid integer")
    if rec.get("coupling", COUPLING) != COUPLING:
        raise StreamError(f"header: coupling {rec['coupling']!r} is not {COUPLING!r}")
    if not isinstance(rec.get("candidate"), dict) or not rec["candidate"].get("policy"):
        raise StreamError("header: 'candidate' must be an object with a 'policy'")
    return rec


def _steps(records: list[dict[str, Any]], rtype: str, T: int, R: int, keys: tuple[str, ...]) -> dict[str, list]:
    """Records 1..T of one type, in order, each holding arrays of length R."""
    cols: dict[str, list] = {k: [] for k in keys}
    for t in range(1, T + 1):
        line = t + 1
        if t > len(records) - 1:
            raise StreamError(f"truncated stream: no end record (stream stops after step {t - 1} of {T})")
        rec = records[t]
        if rec["type"] != rtype or rec.get("step") != t:
            raise StreamError(f"line {line}: expected {rtype} record for step {t}, got "
                              f"{rec['type']!r} step {rec.get('step')!r} (records out of order or missing)")
        for k in keys:
            cols[k].append(_arr(rec, k, R, f"line {line} ({rtype} {t})"))
    return cols


def _branches(records: list[dict[str, Any]], start: int, T: int, W: int, R: int) -> tuple[int, dict[str, np.ndarray]]:
    """Branch records from ``start`` until ``end``; returns the index of ``end`` and the arrays."""
    bstep = np.zeros(R, dtype=TOKEN_DTYPE)
    btv = np.full((R, T), np.nan, dtype=PROB_DTYPE)
    bx = np.full((R, T), MISSING_TOKEN, dtype=TOKEN_DTYPE)
    by = np.full((R, T), MISSING_TOKEN, dtype=TOKEN_DTYPE)
    seen: set[int] = set()
    i = start
    while i < len(records) and records[i]["type"] == "branch":
        rec, where = records[i], f"line {i + 1} (branch)"
        r, t_star = rec.get("replicate"), rec.get("branch_step")
        if not isinstance(r, int) or not 0 <= r < R or r in seen:
            raise StreamError(f"{where}: replicate {r!r} is out of range 0..{R - 1} or repeated")
        if not isinstance(t_star, int) or not 1 <= t_star <= T:
            raise StreamError(f"{where}: branch_step {t_star!r} is outside 1..{T}")
        n = min(W, T - t_star) + 1
        vals = [_arr(rec, k, n, where + f" replicate {r}") for k in ("tv", "x_token", "y_token")]
        seen.add(r)
        bstep[r] = t_star
        btv[r, :n] = _floats([vals[0]])[0]
        bx[r, :n], by[r, :n] = _tokens([vals[1], vals[2]])
        i += 1
    return i, {"branch_step": bstep, "branch_tv": btv, "branch_x_token": bx, "branch_y_token": by}


def _end(records: list[dict[str, Any]], i: int, digest_before: str, T: int, R: int) -> dict[str, Any]:
    if i >= len(records):
        raise StreamError(f"truncated stream: no end record (last record: {records[-1]['type']!r})")
    rec = records[i]
    if rec["type"] != "end":
        raise StreamError(f"line {i + 1}: unexpected {rec['type']!r} record (expected 'end'; records out of order)")
    if i != len(records) - 1:
        raise StreamError(f"line {i + 2}: {records[i + 1]['type']!r} record after 'end'")
    if rec.get("steps") != T or rec.get("replicates") != R:
        raise StreamError(f"end record: steps={rec.get('steps')!r}, replicates={rec.get('replicates')!r} "
                          f"do not match the header (T={T}, R={R})")
    if rec.get("sha256") != digest_before:
        raise StreamError(f"sha256 mismatch: end record says {rec.get('sha256')!r}, the stream hashes to "
                          f"{digest_before!r} (altered or reordered lines)")
    return rec


def _meta(h: dict[str, Any], doc: str | None, end: dict[str, Any]) -> dict[str, Any]:
    """Builder keyword arguments and extra coords from the header."""
    cand = h["candidate"]
    policy = str(cand["policy"])
    press, retention, budget = policy_coords(policy)
    doc_id = doc if doc is not None else (h.get("doc") or h.get("request_id"))
    if not doc_id:
        raise StreamError("no document id: pass doc=..., or the header needs 'doc' or 'request_id'")
    ret = cand.get("retention", retention)
    bud = cand.get("budget", budget)
    # Per-request leftovers (e.g. the service's reference_retained_tokens, press params)
    # go to a (doc, policy) coordinate, so combining requests keeps them.
    extra = {k: v for k, v in h.items() if k not in _KNOWN_HEADER}
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
        prompt_tokens=[int(h.get("prompt_tokens") or 0)],
        press=[str(cand.get("press") or press)],
        retention=[math.nan if ret is None else float(ret)],
        budget=[-1 if bud is None else int(bud)], attrs=attrs,
    )
    seed = h.get("seed")
    coords = {
        "retained_tokens": (("doc", "policy"), np.array([[int(h.get("retained_tokens") or 0)]], dtype=np.int32)),
        "seed": (("doc", "policy"), np.array([[-1 if seed is None else int(seed)]], dtype=np.int64)),
        "request_id": (("doc", "policy"), np.array([[str(h.get("request_id") or "")]], dtype=object)),
        "elapsed_s": (("doc", "policy"), np.array([[float(end.get("elapsed_s") or 0.0)]])),
        "stream_sha256": (("doc", "policy"), np.array([[str(end["sha256"])]], dtype=object)),
        "header_extra": (("doc", "policy"), np.array([[json.dumps(extra, sort_keys=True, default=str)]],
                                                     dtype=object)),
    }
    return {"kwargs": kwargs, "coords": coords}


def assemble(lines: Iterable[str | bytes] | str | bytes, doc: str | None = None) -> xr.Dataset:
    """Turn one request's wire lines into a validated dataset with one doc and one policy.

    Parameters
    ----------
    lines : iterable of str or bytes, or one str / bytes blob
        The stream's lines, with or without their trailing newline, or the whole
        body; SSE framing (``data: {...}`` events separated by blank lines) is
        accepted too.
    doc : str, optional
        The document id; defaults to the header's ``doc`` or ``request_id``.

    Returns
    -------
    xarray.Dataset
        A validated ``coupled`` or ``residual`` dataset (module docstring: how
        header fields become attrs and coordinates).

    Raises
    ------
    StreamError
        A truncated stream (no ``end``), an ``error`` record, a digest mismatch,
        records out of order, arrays of the wrong length or a bad header.
    TraceValidationError
        The numbers break the contract.

    Examples
    --------
    >>> import numpy as np
    >>> from protocols.examples import example_dataset
    >>> from protocols.wire import dataset_lines
    >>> ds = example_dataset(docs=1, policies=1)
    >>> lines = dataset_lines(ds)
    >>> np.array_equal(assemble(lines).tv.values, ds.tv.values)
    True
    >>> try:
    ...     assemble(lines[:-1])
    ... except StreamError as err:
    ...     print(err)
    truncated stream: no end record (last record: 'step')
    """
    raw = _split(lines)
    if not raw:
        raise StreamError("empty stream: no records")
    records, digests = _parse(raw)
    h = _header(records[0])
    T, R, W = h["horizon"], h["replicates"], h["window"]
    if h["kind"] == "coupled":
        cols = _steps(records, "step", T, R, ("tv", "x_token", "y_token"))
        end = _end(records, T + 1, digests[T + 1] if T + 1 < len(digests) else "", T, R)
        # (replicate, step) arrays: the wire carries (step, replicate).
        tv = _floats(cols["tv"]).T.astype(PROB_DTYPE)
        meta = _meta(h, doc, end)
        ds = coupled_dataset(tv, _tokens(cols["x_token"]).T, _tokens(cols["y_token"]).T, **meta["kwargs"])
    else:
        if W > T:
            raise StreamError(f"header: window {W} exceeds horizon {T}")
        cols = _steps(records, "shared_step", T, R, ("tv", "token"))
        i, br = _branches(records, T + 1, T, W, R)
        end = _end(records, i, digests[i] if i < len(digests) else "", T, R)
        meta = _meta(h, doc, end)
        ds = residual_dataset(
            _floats(cols["tv"]).T.astype(PROB_DTYPE), _tokens(cols["token"]).T, br["branch_step"],
            br["branch_tv"], br["branch_x_token"], br["branch_y_token"], window=W, **meta["kwargs"])
    ds = ds.assign_coords(meta["coords"])
    return validate(ds, source=f"(assembled stream, request {h.get('request_id')!r})")
