"""One request's wire stream, read once (docs/contract.md §3): limits, digest, order, shapes.

:class:`StreamReader` takes a stream's lines one at a time, as they arrive over HTTP
or from a journal file, and checks everything that does not need the whole stream:

- each line is parsed with limits (:class:`StreamLimits`: bytes per line, nesting depth,
  integer digits), so a hostile line raises :class:`StreamError` instead of a
  ``RecursionError`` or a ``ValueError`` from deep inside ``json``;
- the header comes first and is well formed; ``step`` (coupled), ``shared_step``
  then ``branch`` (residual) or ``reference_step`` (reference) records follow in
  order, each array of the length the header implies; nothing follows ``end``;
- the running sha256 of every line before ``end`` equals ``end.sha256``, and
  ``end`` repeats the header's T and R;
- a record that names its ``candidate`` (a multi-candidate response, docs/contract.md
  §3) names the header's.

:meth:`StreamReader.finish` returns the checked :class:`Stream`, from which
:func:`protocols.assemble_stream` builds the dataset without reading anything twice.
Both the collector (as bytes arrive) and :func:`protocols.assemble` (a stored
stream) use this one reader.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from protocols.errors import ProtocolError
from protocols.kinds import WIRE_KINDS, Kind
from protocols.logit_fields import LOGIT_FIELDS, LOGIT_TOP, MAX_TOP_LOGPROBS, WIRE_KEY
from protocols.schema import COUPLING, SCHEMA

__all__ = ["STREAM_LIMITS", "StreamLimits", "Stream", "StreamError", "StreamReader", "parse_record", "read_stream"]

#: Why a stream was refused, in :attr:`StreamError.reason`.
REASONS = ("malformed", "truncated", "altered", "failed")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(rb"[\[\]{}]")
#: bytes.translate table: digits -> b"0", everything else -> b" " (C-speed digit-run check).
_DIGIT_MAP = bytes(0x30 if chr(i).isdigit() and i < 128 else 0x20 for i in range(256))


class StreamError(ProtocolError, ValueError):
    """A wire stream that is incomplete, altered, failed or malformed.

    Attributes
    ----------
    reason : str
        ``"malformed"`` (a line or record breaks the format), ``"truncated"`` (no
        ``end``), ``"altered"`` (the digest does not match) or ``"failed"`` (the
        server sent an ``error`` record).
    record : dict or None
        The ``error`` record, when ``reason == "failed"``.
    """

    def __init__(self, message: str, reason: str = "malformed", record: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.record = dict(record) if record is not None else None


@dataclass(frozen=True)
class StreamLimits:
    """Bounds on one wire line: what a well-behaved producer never comes near.

    Attributes
    ----------
    line_bytes : int
        Longest line (the largest real records, 1,024-replicate steps, are ~30 kB; with logit
        traces at top_logprobs 64, ~5.8 MB).
    depth : int
        Deepest nesting of arrays and objects (real records nest 3 deep).
    int_digits : int
        Most digits in an integer literal (int64 has 19).
    """

    line_bytes: int = 16 << 20
    depth: int = 32
    int_digits: int = 20


STREAM_LIMITS = StreamLimits()


def _bounded_int(limit: int):
    def parse(text: str) -> int:
        if len(text.lstrip("-")) > limit:
            raise StreamError(f"integer literal of {len(text)} digits (limit {limit})")
        return int(text)

    return parse


def _reject_constant(name: str) -> float:
    raise StreamError(f"{name} is not JSON (the contract writes null for missing values)")


def _depth(line: bytes) -> int:
    """Deepest bracket nesting outside strings (only run when the line has many brackets)."""
    depth = deepest = 0
    for match in _BRACKET.finditer(_STRING.sub(b'""', line)):
        depth += 1 if match.group() in b"[{" else -1
        deepest = max(deepest, depth)
    return deepest


def parse_record(line: bytes, number: int = 1, limits: StreamLimits = STREAM_LIMITS) -> dict[str, Any]:
    """Parse one wire line into a record, within ``limits``.

    Parameters
    ----------
    line : bytes
        One line without its newline.
    number : int
        Its 1-based line number, for messages.
    limits : StreamLimits
        Size, depth and integer-digit bounds.

    Returns
    -------
    dict
        The record (a JSON object with a ``type``).

    Raises
    ------
    StreamError
        ``reason="malformed"``: too long, too deep, an oversized integer, not UTF-8,
        not JSON, or not an object with a ``type``.

    Examples
    --------
    >>> parse_record(b'{"type":"end","steps":1}')["steps"]
    1
    >>> parse_record(b"[" * 100 + b"]" * 100)
    Traceback (most recent call last):
    protocols.stream.StreamError: line 1: nesting 100 deep (limit 32)
    """
    where = f"line {number}"
    if len(line) > limits.line_bytes:
        raise StreamError(f"{where}: {len(line)} bytes (limit {limits.line_bytes})")
    # Cheap C-speed pre-checks; the exact (slower) ones only for lines that could fail.
    if line.count(b"[") + line.count(b"{") > limits.depth and (d := _depth(line)) > limits.depth:
        raise StreamError(f"{where}: nesting {d} deep (limit {limits.depth})")
    # Integer literals are bounded with a per-int hook only when some digit run is long
    # enough to need it: the hook costs a Python call per integer of a token array.
    long_digits = b"0" * (limits.int_digits + 1) in line.translate(_DIGIT_MAP)
    try:
        text = line.decode("utf-8")
        record = json.loads(text, parse_int=_bounded_int(limits.int_digits) if long_digits else None,
                            parse_constant=_reject_constant)
    except StreamError as exc:
        raise StreamError(f"{where}: {exc}") from None
    except UnicodeDecodeError as exc:
        raise StreamError(f"{where}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except (ValueError, RecursionError) as exc:
        raise StreamError(f"{where}: not a JSON record ({exc}); truncated or corrupted stream") from None
    if not isinstance(record, dict) or not isinstance(record.get("type"), str):
        raise StreamError(f"{where}: record without a 'type' field")
    return record


def _int_field(rec: Mapping[str, Any], key: str, lo: int, hi: int, where: str) -> int:
    value = rec.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise StreamError(f"{where}: {key!r} = {value!r} is not an integer in {lo}..{hi}")
    return value


def check_header(rec: Mapping[str, Any]) -> None:
    """Check a header record's own form (types and ranges); raises :class:`StreamError`."""
    if rec.get("type") != "header":
        raise StreamError(f"line 1: expected a 'header' record first, got {rec.get('type')!r}")
    if rec.get("schema") != SCHEMA:
        raise StreamError(f"header: schema {rec.get('schema')!r} is not {SCHEMA!r}")
    if rec.get("kind") not in WIRE_KINDS:
        raise StreamError(f"header: kind {rec.get('kind')!r} has no wire format ({' or '.join(WIRE_KINDS)})")
    T = _int_field(rec, "horizon", 1, 2**20, "header")
    _int_field(rec, "replicates", 1, 2**20, "header")
    _int_field(rec, "vocab_size", 1, 2**31 - 1, "header")
    W = _int_field(rec, "window", 0, 2**20, "header")
    if rec["kind"] == Kind.RESIDUAL and W > T:
        raise StreamError(f"header: window {W} exceeds horizon {T}")
    if rec["kind"] == Kind.REFERENCE and W != 0:
        raise StreamError(f"header: window {W} for a reference stream (nothing after divergence is observed: 0)")
    if rec.get("coupling", COUPLING) != COUPLING:
        raise StreamError(f"header: coupling {rec['coupling']!r} is not {COUPLING!r}")
    cand = rec.get("candidate")
    if not isinstance(cand, dict) or not isinstance(cand.get("policy"), str) or not cand["policy"]:
        raise StreamError("header: 'candidate' must be an object with a 'policy'")
    if rec.get("top_logprobs") is not None:
        _int_field(rec, "top_logprobs", 0, MAX_TOP_LOGPROBS, "header")
    sha = rec.get("prompt_sha256")
    if sha is not None and not (isinstance(sha, str) and _HEX64.fullmatch(sha)):
        raise StreamError(f"header: prompt_sha256 {sha!r} is not 64 lowercase hex digits")
    _check_compression(rec)


def _layer_list(value: Any, name: str) -> None:
    if not (isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**16
                                            for i in value)):
        raise StreamError(f"header: {name} {value!r} is not a list of layer indices")


def _check_compression(rec: Mapping[str, Any]) -> None:
    """The optional ``compressed_layers``, ``cache_retention`` and ``attention`` (docs/contract.md §3)."""
    if rec.get("compressed_layers") is not None:
        _layer_list(rec["compressed_layers"], "compressed_layers")
    ret = rec.get("cache_retention")
    if ret is not None and not (isinstance(ret, (int, float)) and not isinstance(ret, bool) and 0 <= ret <= 1):
        raise StreamError(f"header: cache_retention {ret!r} is not a number in [0, 1]")
    att = rec.get("attention")
    if att is None:
        return
    if not isinstance(att, dict):
        raise StreamError(f"header: attention {att!r} is not an object")
    for key in ("windowed_layers", "explicit_layers"):
        if att.get(key) is not None:
            _layer_list(att[key], f"attention.{key}")
    windows = att.get("windows")
    if windows is not None and not (isinstance(windows, list) and all(
            isinstance(w, int) and not isinstance(w, bool) and w > 0 for w in windows)):
        raise StreamError(f"header: attention.windows {windows!r} is not a list of positive integers")


@dataclass(frozen=True)
class Stream:
    """A checked stream: its header, data records in order, ``end`` record and digest."""

    header: dict[str, Any]
    records: tuple[dict[str, Any], ...]
    end: dict[str, Any]
    sha256: str

    @property
    def kind(self) -> str:
        return str(self.header["kind"])


#: The per-step record of each kind and the arrays (length R) it carries.
STEP_RECORDS: dict[str, tuple[str, tuple[str, ...]]] = {
    Kind.COUPLED: ("step", ("tv", "x_token", "y_token")),
    Kind.RESIDUAL: ("shared_step", ("tv", "token")),
    Kind.REFERENCE: ("reference_step", ("tv", "x_token", "x_logp", "x_logq")),
}


@dataclass
class _Order:
    """Where the reader is in the record sequence."""

    step: int = 0                      # last step (or shared_step) seen
    branches: set[int] = field(default_factory=set)


class StreamReader:
    """Reads one request's wire lines incrementally and checks them (see the module docstring).

    Parameters
    ----------
    limits : StreamLimits
        Bounds applied to every line.

    Examples
    --------
    >>> from protocols.examples import example_dataset
    >>> from protocols.wire import dataset_lines
    >>> reader = StreamReader()
    >>> for line in dataset_lines(example_dataset(docs=1, policies=1, horizon=3)):
    ...     _ = reader.feed(line)
    >>> reader.finish().header["horizon"]
    3
    """

    def __init__(self, limits: StreamLimits = STREAM_LIMITS) -> None:
        self.limits = limits
        self.lines = 0
        self.header: dict[str, Any] | None = None
        self.end: dict[str, Any] | None = None
        self._records: list[dict[str, Any]] = []
        self._digest = hashlib.sha256()
        self._order = _Order()

    def feed(self, line: bytes | str) -> dict[str, Any] | None:
        """Take one line (newline and SSE ``data:`` framing optional); return its record.

        Blank lines and SSE comments return None. Raises :class:`StreamError` as soon as
        the stream cannot be valid any more (an ``error`` record gives ``reason="failed"``).
        """
        raw = _unframe(line)
        if not raw:
            return None
        self.lines += 1
        n = self.lines
        if self.end is not None:
            rtype = _peek_type(raw)
            raise StreamError(f"line {n}: {rtype!r} record after 'end'")
        rec = parse_record(raw, n, self.limits)
        rtype = rec["type"]
        if rtype == "error":
            raise StreamError(f"line {n}: stream ended with an error record: "
                              f"{rec.get('error_type', '?')}: {rec.get('error', '')}", "failed", rec)
        if self.header is None:
            check_header(rec)
            self.header = rec
        elif rec.get("candidate", self.header["candidate"]["policy"]) != self.header["candidate"]["policy"]:
            # a multi-candidate response's records name their candidate: one of another
            # candidate's lines has been routed into this stream
            raise StreamError(f"line {n}: {rtype!r} record of candidate {rec['candidate']!r} in the stream of "
                              f"{self.header['candidate']['policy']!r}")
        elif rtype == "end":
            self._end(rec, n)
            return rec
        else:
            self._data(rec, n)
            self._records.append(rec)
        self._digest.update(raw + b"\n")
        return rec

    def finish(self) -> Stream:
        """The checked stream; :class:`StreamError` (``reason="truncated"``) if it has no ``end``."""
        if self.header is None:
            raise StreamError("empty stream: no records", "truncated")
        if self.end is None:
            T = self.header["horizon"]
            raise StreamError(f"truncated stream: no end record (stream stops after step {self._order.step} "
                              f"of {T})", "truncated")
        return Stream(self.header, tuple(self._records), self.end, str(self.end["sha256"]))

    # -- checks per record
    def _data(self, rec: dict[str, Any], n: int) -> None:
        h = self.header
        assert h is not None
        T, R = h["horizon"], h["replicates"]
        step_type, keys = STEP_RECORDS[h["kind"]]
        if self._order.step < T:
            t = self._order.step + 1
            if rec["type"] != step_type or rec.get("step") != t:
                raise StreamError(f"line {n}: expected {step_type} record for step {t}, got {rec['type']!r} "
                                  f"step {rec.get('step')!r} (records out of order or missing)")
            for key in keys:
                _array(rec, key, R, f"line {n} ({step_type} {t})")
            _logits(rec, R, int(h.get("top_logprobs") or 0), f"line {n} ({step_type} {t})")
            self._order.step = t
            return
        if rec["type"] != "branch" or h["kind"] != Kind.RESIDUAL:
            raise StreamError(f"line {n}: unexpected {rec['type']!r} record (expected 'end'; records out of order)")
        self._branch(rec, n, T, R, h["window"])

    def _branch(self, rec: dict[str, Any], n: int, T: int, R: int, W: int) -> None:
        where = f"line {n} (branch)"
        r, t_star = rec.get("replicate"), rec.get("branch_step")
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < R or r in self._order.branches:
            raise StreamError(f"{where}: replicate {r!r} is out of range 0..{R - 1} or repeated")
        if not isinstance(t_star, int) or isinstance(t_star, bool) or not 1 <= t_star <= T:
            raise StreamError(f"{where}: branch_step {t_star!r} is outside 1..{T}")
        size = min(W, T - t_star) + 1
        for key in ("tv", "x_token", "y_token"):
            _array(rec, key, size, f"{where} replicate {r}")
        assert self.header is not None
        _logits(rec, size, int(self.header.get("top_logprobs") or 0), f"{where} replicate {r}")
        self._order.branches.add(r)

    def _end(self, rec: dict[str, Any], n: int) -> None:
        h = self.header
        assert h is not None
        T, R = h["horizon"], h["replicates"]
        if self._order.step < T:
            step_type = STEP_RECORDS[h["kind"]][0]
            raise StreamError(f"line {n}: 'end' after step {self._order.step} of {T} (expected {step_type} "
                              f"record for step {self._order.step + 1}; records out of order or missing)")
        if rec.get("steps") != T or rec.get("replicates") != R:
            raise StreamError(f"end record: steps={rec.get('steps')!r}, replicates={rec.get('replicates')!r} "
                              f"do not match the header (T={T}, R={R})")
        digest = self._digest.hexdigest()
        if rec.get("sha256") != digest:
            raise StreamError(f"sha256 mismatch: end record says {rec.get('sha256')!r}, the stream hashes to "
                              f"{digest!r} (altered or reordered lines)", "altered")
        self.end = rec


def _array(rec: Mapping[str, Any], key: str, size: int, where: str) -> None:
    vals = rec.get(key)
    if not isinstance(vals, list) or len(vals) != size:
        got = len(vals) if isinstance(vals, list) else type(vals).__name__
        raise StreamError(f"{where}: '{key}' must be a list of length {size}, got {got}")


def _logits(rec: Mapping[str, Any], size: int, k: int, where: str) -> None:
    """The record's ``logits`` object (protocols.logit_fields): present exactly when the header's
    ``top_logprobs`` k > 0, every field a list of ``size`` rows, each top row null or of length k."""
    obj = rec.get(WIRE_KEY)
    if not k:
        if obj is not None:
            raise StreamError(f"{where}: '{WIRE_KEY}' in a record, but the header's top_logprobs is 0 or absent")
        return
    if not isinstance(obj, dict) or set(obj) != set(LOGIT_FIELDS):
        got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise StreamError(f"{where}: '{WIRE_KEY}' must be an object with the fields {list(LOGIT_FIELDS)} "
                          f"(top_logprobs = {k}), got {got}")
    for key in LOGIT_FIELDS:
        _array(obj, key, size, f"{where} {WIRE_KEY}")
        if key in LOGIT_TOP and not all(row is None or (isinstance(row, list) and len(row) == k) for row in obj[key]):
            raise StreamError(f"{where}: every row of '{WIRE_KEY}.{key}' must be null or a list of {k} values")


def _peek_type(raw: bytes) -> str:
    try:
        return str(parse_record(raw)["type"])
    except StreamError:
        return "unreadable"


def _unframe(line: bytes | str) -> bytes:
    """Exact line bytes without the newline; SSE ``data: <record>`` -> the record, other SSE fields -> b''."""
    b = line.encode("utf-8") if isinstance(line, str) else bytes(line)
    if b.endswith(b"\n"):
        b = b[:-1]  # exactly one: the digest re-adds it
    if b.startswith(b"data:"):
        b = b[5:]
        return b[1:] if b.startswith(b" ") else b
    if b.startswith((b":", b"event:", b"id:", b"retry:")):
        return b""
    return b if b.strip() else b""


def read_stream(lines: Iterable[str | bytes] | str | bytes, limits: StreamLimits = STREAM_LIMITS) -> Stream:
    """Read a whole stream with one :class:`StreamReader`.

    Parameters
    ----------
    lines : iterable of str or bytes, or one str or bytes blob
        The stream's lines (newlines optional) or its whole body; SSE framing accepted.
    limits : StreamLimits
        Bounds applied to every line.

    Returns
    -------
    Stream
        The checked header, data records, ``end`` record and digest.

    Raises
    ------
    StreamError
        For the first problem found (see :attr:`StreamError.reason`).

    Examples
    --------
    >>> from protocols.examples import example_dataset
    >>> from protocols.wire import dataset_lines
    >>> stream = read_stream(b"".join(dataset_lines(example_dataset(docs=1, policies=1, horizon=4))))
    >>> len(stream.records), stream.end["steps"]
    (4, 4)
    """
    if isinstance(lines, (str, bytes)):
        blob = lines.encode("utf-8") if isinstance(lines, str) else lines
        lines = blob.split(b"\n")
    reader = StreamReader(limits)
    for line in lines:
        reader.feed(line)
    return reader.finish()
