"""Wire records of ``kvdiv.trace/1`` (docs/contract.md §3): one serialiser per record type.

A stream is NDJSON: one JSON object per line, ``header``, then ``step`` records
(coupled) or ``shared_step`` then ``branch`` records (residual), then ``end``,
whose ``sha256`` is the hex digest of the exact UTF-8 bytes of every preceding
line including its newline. :class:`StreamWriter` keeps that digest as lines are
produced; :func:`protocols.assemble` checks it on the way back in.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from protocols.schema import SCHEMA

RECORD_TYPES = ("header", "step", "shared_step", "branch", "end", "error")


def prompt_digest(token_ids: Sequence[int]) -> str:
    """The header's ``prompt_sha256``: sha256 of the prompt token ids as decimal ASCII joined by ``,``.

    A producer-independent digest of exactly the tokens the server prefilled, so a
    client can tell that every policy of a document saw the same prompt
    (docs/contract.md §3).

    Parameters
    ----------
    token_ids : sequence of int
        The prompt's token ids, in order (special tokens included).

    Returns
    -------
    str
        64 lowercase hex digits.

    Examples
    --------
    >>> prompt_digest([1, 2, 3]) == hashlib.sha256(b"1,2,3").hexdigest()
    True
    """
    return hashlib.sha256(",".join(str(int(t)) for t in token_ids).encode("ascii")).hexdigest()


def _clean(values: Sequence[Any] | None, *, floats: bool) -> list[Any] | None:
    """JSON-safe list: NaN (floats) and None become null, numpy scalars become Python."""
    if values is None:
        return None
    out: list[Any] = []
    for v in values:
        if v is None:
            out.append(None)
        elif floats:
            f = float(v)
            out.append(None if math.isnan(f) else f)
        else:
            i = int(v)
            out.append(None if i < 0 else i)
    return out


def header_record(
    *,
    kind: str,
    horizon: int,
    window: int,
    model: str,
    eos_token_id: int | None,
    sampling: Mapping[str, Any],
    candidate: Mapping[str, Any],
    seed: int | None,
    prompt_tokens: int,
    retained_tokens: int,
    replicates: int,
    vocab_size: int,
    doc: str | None = None,
    request_id: str = "",
    reference: Mapping[str, Any] | None = None,
    prompt_sha256: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The stream's first record: everything needed to build the dataset's attrs.

    ``prompt_sha256`` is :func:`prompt_digest` of the prompt's token ids (null when
    the producer does not know them); a client checks it against the other requests
    for the same document.
    """
    rec = {
        "type": "header", "schema": SCHEMA, "kind": kind, "horizon": int(horizon),
        "window": int(window), "model": model,
        "eos_token_id": -1 if eos_token_id is None else int(eos_token_id),
        "sampling": dict(sampling), "reference": dict(reference or {"policy": "full"}),
        "candidate": dict(candidate), "seed": seed, "prompt_tokens": int(prompt_tokens),
        "retained_tokens": int(retained_tokens), "replicates": int(replicates),
        "vocab_size": int(vocab_size), "doc": doc, "request_id": request_id, "prompt_sha256": prompt_sha256,
    }
    rec.update(extra)
    return rec


def step_record(step: int, tv: Sequence[float], x_token: Sequence[int], y_token: Sequence[int]) -> dict[str, Any]:
    """Coupled kind: one step over all replicates."""
    return {"type": "step", "step": int(step), "tv": _clean(tv, floats=True),
            "x_token": _clean(x_token, floats=False), "y_token": _clean(y_token, floats=False)}


def shared_step_record(step: int, tv: Sequence[float | None], token: Sequence[int | None]) -> dict[str, Any]:
    """Residual kind: one survival-path step over all replicates (null where stopped)."""
    return {"type": "shared_step", "step": int(step), "tv": _clean(tv, floats=True),
            "token": _clean(token, floats=False)}


def branch_record(
    replicate: int, branch_step: int, tv: Sequence[float], x_token: Sequence[int], y_token: Sequence[int]
) -> dict[str, Any]:
    """Residual kind: one replicate's branch, ages 0..K (K+1 entries)."""
    return {"type": "branch", "replicate": int(replicate), "branch_step": int(branch_step),
            "tv": _clean(tv, floats=True), "x_token": _clean(x_token, floats=False),
            "y_token": _clean(y_token, floats=False)}


def end_record(steps: int, replicates: int, elapsed_s: float, sha256: str) -> dict[str, Any]:
    return {"type": "end", "steps": int(steps), "replicates": int(replicates),
            "elapsed_s": float(elapsed_s), "sha256": sha256}


def error_record(error: str, error_type: str) -> dict[str, Any]:
    """Sent instead of ``end`` when a stream fails; the request is never complete."""
    return {"type": "error", "error": str(error), "error_type": str(error_type)}


def encode_line(record: Mapping[str, Any]) -> bytes:
    """One NDJSON line (compact JSON, UTF-8, trailing newline)."""
    return (json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n").encode("utf-8")


class StreamWriter:
    """Encodes records to lines and keeps the running sha256 for the ``end`` record."""

    def __init__(self) -> None:
        self._digest = hashlib.sha256()
        self.lines = 0

    def line(self, record: Mapping[str, Any]) -> bytes:
        data = encode_line(record)
        self._digest.update(data)
        self.lines += 1
        return data

    def end(self, steps: int, replicates: int, elapsed_s: float) -> bytes:
        """The ``end`` line, carrying the digest of every line written before it."""
        return encode_line(end_record(steps, replicates, elapsed_s, self._digest.hexdigest()))

    @property
    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def dataset_lines(
    ds: Any,
    *,
    doc: str | None = None,
    policy: str | None = None,
    seed: int | None = None,
    retained_tokens: int = 0,
    request_id: str = "",
    elapsed_s: float = 0.0,
) -> list[bytes]:
    """Serialise one (doc, policy) cell of a coupled or residual dataset as a wire stream.

    The inverse of :func:`protocols.assemble` (used by tests and by anyone replaying
    stored traces through the wire path). ``doc`` / ``policy`` pick the cell;
    both default to the only one.
    """
    import numpy as np

    doc = str(ds.doc.values[0]) if doc is None else doc
    policy = str(ds.policy.values[0]) if policy is None else policy
    cell = ds.sel(doc=doc, policy=policy)
    a, kind = ds.attrs, ds.attrs["kind"]
    T, R = int(a["horizon"]), cell.sizes["replicate"]
    w = StreamWriter()
    lines = [w.line(header_record(
        kind=kind, horizon=T, window=int(a["window"]), model=a["model"], eos_token_id=int(a["eos_token_id"]),
        sampling=json.loads(a["sampling"]),
        candidate={"policy": policy, "press": str(cell.press.values),
                   "retention": None if np.isnan(cell.retention.values) else float(cell.retention.values),
                   "budget": None if int(cell.budget.values) < 0 else int(cell.budget.values)},
        seed=seed, prompt_tokens=int(cell.prompt_tokens.values), retained_tokens=retained_tokens,
        replicates=R, vocab_size=int(a["vocab_size"]), doc=doc, request_id=request_id,
        producer=a["producer"],
    ))]
    if kind == "coupled":
        tv, x, y = (cell[v].transpose("replicate", "step").values for v in ("tv", "x_token", "y_token"))
        lines += [w.line(step_record(t + 1, tv[:, t], x[:, t], y[:, t])) for t in range(T)]
    elif kind == "residual":
        tv, tok = (cell[v].transpose("replicate", "step").values for v in ("shared_tv", "shared_token"))
        lines += [w.line(shared_step_record(t + 1, tv[:, t], tok[:, t])) for t in range(T)]
        bs = cell.branch_step.values
        btv, bx, by = (cell[v].transpose("replicate", "age").values
                       for v in ("branch_tv", "branch_x_token", "branch_y_token"))
        for r in range(R):
            if bs[r] > 0:
                n = min(int(a["window"]), T - int(bs[r])) + 1
                lines.append(w.line(branch_record(r, int(bs[r]), btv[r, :n], bx[r, :n], by[r, :n])))
    else:
        raise ValueError(f"kind {kind!r} has no wire format (coupled or residual)")
    lines.append(w.end(T, R, elapsed_s))
    return lines
