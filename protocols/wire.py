"""Wire records of ``kvdiv.trace/1`` (docs/contract.md §3): one serialiser per record type.

A stream is NDJSON: one JSON object per line, ``header``, then ``step`` records
(coupled), ``shared_step`` then ``branch`` records (residual) or ``reference_step``
records (reference), then ``end``,
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

from protocols.kinds import Kind
from protocols.logit_fields import LOGIT_FIELDS, WIRE_KEY, logit_vars, wire_logits
from protocols.schema import SCHEMA, eos_ids, eos_set

__all__ = [
    "prompt_digest",
    "RECORD_TYPES", "StreamWriter", "branch_record", "dataset_lines", "encode_line", "end_record",
    "error_record", "header_record", "reference_step_record", "shared_step_record", "step_record",
]

RECORD_TYPES = ("header", "step", "shared_step", "branch", "reference_step", "end", "error")


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

    Raises
    ------
    TypeError, ValueError
        A token id that is not an integer.

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
    eos_token_ids: Sequence[int] | None = None,
    dtype: str | None = None,
    fused: bool | None = None,
    device: str | None = None,
    fuse: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The stream's first record: everything needed to build the dataset's attrs.

    Parameters
    ----------
    kind : {"coupled", "residual", "reference"}
        The trace kind.
    horizon, window, replicates, vocab_size : int
        T, W, R and V (W is 0 for reference traces: nothing after divergence is observed).
    model : str
        The model name.
    eos_token_id : int or None
        The EOS token (None is sent as -1).
    eos_token_ids : sequence of int, optional
        Every EOS id of the model (each ends a side and is absorbing);
        ``eos_token_id`` must be one of them and the header carries the list
        (default: ``[eos_token_id]``, or ``[]`` for none).
    sampling : mapping
        Sampling parameters.
    candidate : mapping
        At least ``policy``; ``press``, ``retention`` and ``budget`` optional.
    seed : int or None
        The request's seed (None: the service drew one).
    prompt_tokens, retained_tokens : int
        Prompt length and prompt tokens the candidate's cache kept.
    doc : str, optional
        The document id.
    request_id : str
        The service's request id.
    reference : mapping, optional
        The reference policy, default ``{"policy": "full"}``.
    prompt_sha256 : str, optional
        :func:`prompt_digest` of the prompt's token ids (null when the producer
        does not know them); a client checks it against the other requests for
        the same document.
    dtype, fused, device, fuse : optional
        The numerics (docs/contract.md §3, optional; left out when None): the dtype of
        the model's weights (``"float32"``, ``"bfloat16"``), whether P's and Q's
        forwards ran as one fused forward (None: decided per step), the device type
        (``"cpu"``, ``"cuda"``) and the server's fusion mode (``"on"``, ``"off"``,
        ``"auto"``). ``kvdiv pack`` refuses to mix traces whose numerics differ.
    **extra
        Further header keys (kept by :func:`protocols.assemble.assemble` in
        the ``header_extra`` coordinate).

    Returns
    -------
    dict
        The record (``type`` = ``"header"``, ``schema`` = ``kvdiv.trace/1``).

    Raises
    ------
    TypeError, ValueError
        A count that is not an integer.

    Examples
    --------
    >>> rec = header_record(kind="coupled", horizon=4, window=4, model="m", eos_token_id=None,
    ...                     sampling={}, candidate={"policy": "snapkv@0.5"}, seed=1, prompt_tokens=9,
    ...                     retained_tokens=5, replicates=2, vocab_size=10)
    >>> rec["type"], rec["eos_token_id"], rec["reference"]
    ('header', -1, {'policy': 'full'})
    """
    eos = eos_set(eos_token_id, eos_token_ids)
    rec = {
        "type": "header", "schema": SCHEMA, "kind": kind, "horizon": int(horizon),
        "window": int(window), "model": model,
        "eos_token_id": int(eos_token_id) if eos_token_id is not None and eos_token_id >= 0 else (eos or (-1,))[0],
        "eos_token_ids": list(eos),
        "sampling": dict(sampling), "reference": dict(reference or {"policy": "full"}),
        "candidate": dict(candidate), "seed": seed, "prompt_tokens": int(prompt_tokens),
        "retained_tokens": int(retained_tokens), "replicates": int(replicates),
        "vocab_size": int(vocab_size), "doc": doc, "request_id": request_id, "prompt_sha256": prompt_sha256,
    }
    numerics = {"dtype": dtype, "fused": None if fused is None else bool(fused), "device": device, "fuse": fuse}
    rec.update({k: v for k, v in numerics.items() if v is not None})
    rec.update(extra)
    return rec


def step_record(step: int, tv: Sequence[float], x_token: Sequence[int], y_token: Sequence[int],
                logits: Mapping[str, list] | None = None) -> dict[str, Any]:
    """Coupled kind: one step over all replicates.

    Parameters
    ----------
    step : int
        t, 1-based.
    tv : sequence of float
        TV per replicate (NaN becomes null).
    x_token, y_token : sequence of int
        Tokens per replicate (negative becomes null).
    logits : mapping, optional
        The logit traces of the step (:func:`protocols.logit_fields.wire_logits`), sent as
        the record's ``logits`` object when the request asked for ``top_logprobs``.

    Returns
    -------
    dict
        The ``step`` record.

    Raises
    ------
    TypeError, ValueError
        A value that is not a number.

    Examples
    --------
    >>> step_record(1, [0.0, 0.25], [3, 3], [3, 4])
    {'type': 'step', 'step': 1, 'tv': [0.0, 0.25], 'x_token': [3, 3], 'y_token': [3, 4]}
    """
    return _with_logits({"type": "step", "step": int(step), "tv": _clean(tv, floats=True),
                         "x_token": _clean(x_token, floats=False), "y_token": _clean(y_token, floats=False)}, logits)


def _with_logits(rec: dict[str, Any], logits: Mapping[str, list] | None) -> dict[str, Any]:
    if logits is not None:
        rec[WIRE_KEY] = dict(logits)
    return rec


def shared_step_record(step: int, tv: Sequence[float | None], token: Sequence[int | None],
                       logits: Mapping[str, list] | None = None) -> dict[str, Any]:
    """Residual kind: one survival-path step over all replicates (null where stopped).

    Parameters
    ----------
    step : int
        t, 1-based.
    tv : sequence of float or None
        TV on each replicate's survival path; NaN / None after it stopped.
    token : sequence of int or None
        Z_t per replicate; -1 / None where none was drawn.
    logits : mapping, optional
        The step's logit traces (as :func:`step_record`), null rows after a path stopped.

    Returns
    -------
    dict
        The ``shared_step`` record.

    Raises
    ------
    TypeError, ValueError
        A value that is not a number.

    Examples
    --------
    >>> shared_step_record(2, [1.0, None], [-1, None])
    {'type': 'shared_step', 'step': 2, 'tv': [1.0, None], 'token': [None, None]}
    """
    return _with_logits({"type": "shared_step", "step": int(step), "tv": _clean(tv, floats=True),
                         "token": _clean(token, floats=False)}, logits)


def reference_step_record(step: int, tv: Sequence[float], x_token: Sequence[int], x_logp: Sequence[float],
                          x_logq: Sequence[float], logits: Mapping[str, list] | None = None) -> dict[str, Any]:
    """Reference kind: one step over all replicates of paths sampled from P.

    Q scores the token P sampled, on the same history, so the record holds the token,
    its log-probability under both laws and the TV between them.

    Parameters
    ----------
    step : int
        t, 1-based.
    tv : sequence of float
        TV(p_t, q_t) per replicate, both laws on the history x_<t.
    x_token : sequence of int
        x_t per replicate, drawn from p_t.
    x_logp, x_logq : sequence of float
        log p_t(x_t) and log q_t(x_t); a log q of -inf (q gave the token no mass:
        top-k, top-p) is sent as null, the only null the record may hold.
    logits : mapping, optional
        The logit traces of the step (:func:`protocols.logit_fields.wire_logits`), as
        for :func:`step_record`.

    Returns
    -------
    dict
        The ``reference_step`` record.

    Raises
    ------
    TypeError, ValueError
        A value that is not a number.

    Examples
    --------
    >>> reference_step_record(1, [0.25], [3], [-0.5], [float("-inf")])
    {'type': 'reference_step', 'step': 1, 'tv': [0.25], 'x_token': [3], 'x_logp': [-0.5], 'x_logq': [None]}
    """
    logq = [None if math.isinf(f := float(v)) and f < 0 else f for v in x_logq]
    return _with_logits({"type": "reference_step", "step": int(step), "tv": _clean(tv, floats=True),
                         "x_token": _clean(x_token, floats=False), "x_logp": _clean(x_logp, floats=True),
                         "x_logq": _clean(logq, floats=True)}, logits)


def branch_record(
    replicate: int, branch_step: int, tv: Sequence[float], x_token: Sequence[int], y_token: Sequence[int],
    logits: Mapping[str, list] | None = None,
) -> dict[str, Any]:
    """Residual kind: one replicate's branch, ages 0..K (K+1 entries).

    Parameters
    ----------
    replicate : int
        The replicate, 0-based.
    branch_step : int
        t*, 1..T.
    tv, x_token, y_token : sequence
        The branches' TV and tokens at ages 0..K, K = min(W, T - t*).
    logits : mapping, optional
        The branches' logit traces at ages 0..K (as :func:`step_record`, one row per age).

    Returns
    -------
    dict
        The ``branch`` record.

    Raises
    ------
    TypeError, ValueError
        A value that is not a number.

    Examples
    --------
    >>> branch_record(0, 3, [0.5], [1], [2])
    {'type': 'branch', 'replicate': 0, 'branch_step': 3, 'tv': [0.5], 'x_token': [1], 'y_token': [2]}
    """
    return _with_logits({"type": "branch", "replicate": int(replicate), "branch_step": int(branch_step),
                         "tv": _clean(tv, floats=True), "x_token": _clean(x_token, floats=False),
                         "y_token": _clean(y_token, floats=False)}, logits)


def end_record(steps: int, replicates: int, elapsed_s: float, sha256: str,
               candidate: str | None = None) -> dict[str, Any]:
    """The stream's last record: its size, its duration and the digest of every line before it.

    Parameters
    ----------
    steps, replicates : int
        T and R, repeated so that a reader can check the stream is complete.
    elapsed_s : float
        Seconds the request took.
    sha256 : str
        Hex sha256 of the exact bytes of every preceding line, newlines included.
    candidate : str, optional
        The candidate's policy id, in a multi-candidate response (docs/contract.md §3).

    Returns
    -------
    dict
        The ``end`` record.

    Raises
    ------
    TypeError, ValueError
        A count or time that is not a number.

    Examples
    --------
    >>> end_record(4, 2, 0.5, "ab")
    {'type': 'end', 'steps': 4, 'replicates': 2, 'elapsed_s': 0.5, 'sha256': 'ab'}
    """
    rec: dict[str, Any] = {"type": "end", "steps": int(steps), "replicates": int(replicates),
                           "elapsed_s": float(elapsed_s), "sha256": sha256}
    if candidate is not None:
        rec["candidate"] = str(candidate)
    return rec


def error_record(error: str, error_type: str, candidate: str | None = None) -> dict[str, Any]:
    """Sent instead of ``end`` when a stream fails; the request is never complete.

    Parameters
    ----------
    error : str
        What went wrong.
    error_type : str
        A short class name for it (e.g. the exception's type).
    candidate : str, optional
        The candidate whose stream fails, in a multi-candidate response.

    Returns
    -------
    dict
        The ``error`` record.

    Raises
    ------
    None

    Examples
    --------
    >>> error_record("out of memory", "RuntimeError")
    {'type': 'error', 'error': 'out of memory', 'error_type': 'RuntimeError'}
    """
    rec = {"type": "error", "error": str(error), "error_type": str(error_type)}
    if candidate is not None:
        rec["candidate"] = str(candidate)
    return rec


def encode_line(record: Mapping[str, Any]) -> bytes:
    """One NDJSON line (compact JSON, UTF-8, trailing newline).

    Parameters
    ----------
    record : mapping
        A record from one of this module's builders.

    Returns
    -------
    bytes
        The line, newline included (the digest covers these exact bytes).

    Raises
    ------
    ValueError
        A NaN or infinity in the record (the builders turn NaN into null).

    Examples
    --------
    >>> encode_line({"type": "end", "steps": 1})
    b'{"type":"end","steps":1}\\n'
    """
    return (json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n").encode("utf-8")


class StreamWriter:
    """Encodes records to lines and keeps the running sha256 for the ``end`` record.

    Examples
    --------
    >>> w = StreamWriter()
    >>> first = w.line(step_record(1, [0.0], [1], [1]))
    >>> last = w.end(1, 1, 0.0)
    >>> import hashlib, json
    >>> json.loads(last)["sha256"] == hashlib.sha256(first).hexdigest()
    True
    """

    def __init__(self) -> None:
        self._digest = hashlib.sha256()
        self.lines = 0

    def line(self, record: Mapping[str, Any]) -> bytes:
        """Encode ``record`` as one line and add its bytes to the digest."""
        data = encode_line(record)
        self._digest.update(data)
        self.lines += 1
        return data

    def end(self, steps: int, replicates: int, elapsed_s: float, candidate: str | None = None) -> bytes:
        """The ``end`` line, carrying the digest of every line written before it (and the
        candidate's policy id in a multi-candidate response)."""
        return encode_line(end_record(steps, replicates, elapsed_s, self._digest.hexdigest(), candidate))

    @property
    def hexdigest(self) -> str:
        """Hex sha256 of every line written so far."""
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
    """Serialise one (doc, policy) cell of a trace dataset as a wire stream.

    The inverse of :func:`protocols.assemble` (used by tests and by anyone replaying
    stored traces through the wire path). ``doc`` / ``policy`` pick the cell;
    both default to the only one.

    Parameters
    ----------
    ds : xarray.Dataset
        A ``coupled``, ``residual`` or ``reference`` dataset (a reference dataset
        without ``tv`` is sent with null TVs, which :func:`protocols.assemble` refuses).
    doc, policy : str, optional
        The cell to send; default the first doc and the first policy.
    seed, retained_tokens, request_id, elapsed_s : optional
        Header and end fields that the dataset does not hold.

    Returns
    -------
    list of bytes
        The stream's lines, ``header`` first and ``end`` last.

    Raises
    ------
    ValueError
        A dataset whose kind has no wire format.
    KeyError
        ``doc`` or ``policy`` is not in the dataset.

    Examples
    --------
    >>> from protocols.examples import example_dataset
    >>> lines = dataset_lines(example_dataset(horizon=3))
    >>> [json.loads(line)["type"] for line in lines]
    ['header', 'step', 'step', 'step', 'end']
    """
    import numpy as np

    doc = str(ds.doc.values[0]) if doc is None else doc
    policy = str(ds.policy.values[0]) if policy is None else policy
    cell = ds.sel(doc=doc, policy=policy)
    a, kind = ds.attrs, ds.attrs["kind"]
    T, R = int(a["horizon"]), cell.sizes["replicate"]
    logit_names = logit_vars(ds)
    k = int(ds.sizes["top"]) if logit_names else 0

    def logits(prefix: str, dim: str, at: int, n: int | None = None) -> dict[str, list] | None:
        """One record's ``logits`` object from the cell's variables of ``prefix`` (rows: replicates,
        or the first ``n`` ages of replicate ``at``)."""
        if not k:
            return None
        rows = {}
        for name in LOGIT_FIELDS:
            v = cell[prefix + name]
            if n is None:   # one step, every replicate
                rows[name] = v.isel({dim: at}).transpose("replicate", ...).values
            else:           # one replicate's branch, ages 0..n-1
                rows[name] = v.isel({"replicate": at, dim: slice(0, n)}).transpose(dim, ...).values
        seen = ~np.isnan(rows["entropy_p"])
        return wire_logits(rows, seen.tolist())

    w = StreamWriter()
    lines = [w.line(header_record(
        kind=kind, horizon=T, window=int(a["window"]), model=a["model"], eos_token_id=int(a["eos_token_id"]),
        eos_token_ids=eos_ids(a),
        sampling=json.loads(a["sampling"]),
        candidate={"policy": policy, "press": str(cell.press.values),
                   "retention": None if np.isnan(cell.retention.values) else float(cell.retention.values),
                   "budget": None if int(cell.budget.values) < 0 else int(cell.budget.values)},
        seed=seed, prompt_tokens=int(cell.prompt_tokens.values), retained_tokens=retained_tokens,
        replicates=R, vocab_size=int(a["vocab_size"]), doc=doc, request_id=request_id,
        producer=a["producer"], **({"top_logprobs": k} if k else {}),
    ))]
    if kind == Kind.COUPLED:
        tv, x, y = (cell[v].transpose("replicate", "step").values for v in ("tv", "x_token", "y_token"))
        lines += [w.line(step_record(t + 1, tv[:, t], x[:, t], y[:, t], logits("", "step", t))) for t in range(T)]
    elif kind == Kind.RESIDUAL:
        tv, tok = (cell[v].transpose("replicate", "step").values for v in ("shared_tv", "shared_token"))
        lines += [w.line(shared_step_record(t + 1, tv[:, t], tok[:, t], logits("shared_", "step", t)))
                  for t in range(T)]
        bs = cell.branch_step.values
        btv, bx, by = (cell[v].transpose("replicate", "age").values
                       for v in ("branch_tv", "branch_x_token", "branch_y_token"))
        for r in range(R):
            if bs[r] > 0:
                n = min(int(a["window"]), T - int(bs[r])) + 1
                lines.append(w.line(branch_record(r, int(bs[r]), btv[r, :n], bx[r, :n], by[r, :n],
                                                  logits("branch_", "age", r, n))))
    elif kind == Kind.REFERENCE:
        x, lp, lq = (cell[v].transpose("replicate", "step").values for v in ("x_token", "x_logp", "x_logq"))
        tv = cell["tv"].transpose("replicate", "step").values if "tv" in cell else np.full(x.shape, np.nan)
        lines += [w.line(reference_step_record(t + 1, tv[:, t], x[:, t], lp[:, t], lq[:, t],
                                               logits("", "step", t))) for t in range(T)]
    else:
        raise ValueError(f"kind {kind!r} has no wire format (coupled, residual or reference)")
    lines.append(w.end(T, R, elapsed_s))
    return lines
