"""Wire records of ``kvdiv.trace/1`` (SCHEMA.md §3): one serialiser per record type.

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
    **extra: Any,
) -> dict[str, Any]:
    """The stream's first record: everything needed to build the dataset's attrs."""
    rec = {
        "type": "header", "schema": SCHEMA, "kind": kind, "horizon": int(horizon),
        "window": int(window), "model": model,
        "eos_token_id": -1 if eos_token_id is None else int(eos_token_id),
        "sampling": dict(sampling), "reference": dict(reference or {"policy": "full"}),
        "candidate": dict(candidate), "seed": seed, "prompt_tokens": int(prompt_tokens),
        "retained_tokens": int(retained_tokens), "replicates": int(replicates),
        "vocab_size": int(vocab_size), "doc": doc, "request_id": request_id,
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
