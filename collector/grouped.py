"""One request per document: a document's policies as the candidates of one ``/v1/traces``.

A server that advertises ``trace_candidates`` in ``/info`` (docs/service.md, "Several
candidates in one request") takes ``candidates`` (policy ids) with ``seeds`` parallel
to them, prefills the prompt once per candidate and decodes every candidate's rows in
shared batched forwards. Its response multiplexes one complete ``kvdiv.trace/1`` stream
per candidate: every record carries ``candidate`` (the header through
``candidate.policy``), and each candidate's stream ends with its own ``end`` (its own
digest) or ``error`` record (docs/contract.md §3, "Several candidates").

The collector builds the group's body from the per-(document, policy) bodies
(:func:`group_body`: they must agree on everything but the candidate and its seed,
so each candidate's seed is exactly the one its own request would carry), and splits
the response line by line (:class:`CandidateSplitter`) into the per-(document, policy)
journal files, so resume, audit and pack see what one request per policy would have
written, plus the ``candidate`` keys.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from protocols.stream import STREAM_LIMITS, StreamError, parse_record

__all__ = ["CandidateSplitter", "group_body", "groupable", "max_candidates"]


def _without_candidate(body: Mapping[str, Any]) -> dict[str, Any]:
    rest = {k: v for k, v in body.items() if k != "candidate"}
    rest["parameters"] = {k: v for k, v in body.get("parameters", {}).items() if k != "seed"}
    return rest


def groupable(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two ``/v1/traces`` bodies differ only in ``candidate`` and ``parameters.seed``.

    Examples
    --------
    >>> a = {"inputs": "x", "candidate": "snapkv@0.5", "parameters": {"seed": 1, "max_new_tokens": 4}}
    >>> groupable(a, {**a, "candidate": "recent@0.5", "parameters": {"seed": 2, "max_new_tokens": 4}})
    True
    >>> groupable(a, {**a, "replicates": 16})
    False
    """
    return _without_candidate(a) == _without_candidate(b)


def group_body(bodies: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One multi-candidate body from one-candidate bodies of the same document.

    Parameters
    ----------
    bodies : sequence of mapping
        ``/v1/traces`` bodies (``collector.jobs.request_body``) that agree on
        everything but ``candidate`` and ``parameters.seed`` (:func:`groupable`).

    Returns
    -------
    dict
        The body with ``candidates`` and ``seeds`` (each body's seed, None where it has
        none) in the order given, and no ``candidate`` or ``parameters.seed``.

    Raises
    ------
    ValueError
        Bodies that differ in anything else, or name one policy twice.

    Examples
    --------
    >>> a = {"inputs": "x", "candidate": "snapkv@0.5", "parameters": {"seed": 1}}
    >>> group_body([a, {**a, "candidate": "recent@0.5", "parameters": {"seed": 2}}])
    {'inputs': 'x', 'parameters': {}, 'candidates': ['snapkv@0.5', 'recent@0.5'], 'seeds': [1, 2]}
    """
    if not bodies:
        raise ValueError("no bodies to group")
    first = bodies[0]
    if not all(groupable(first, b) for b in bodies[1:]):
        raise ValueError("bodies differ in more than candidate and seed")
    policies = [b["candidate"] for b in bodies]
    if len(set(policies)) != len(policies):
        raise ValueError(f"a policy appears twice in {policies}")
    body = _without_candidate(first)
    body["candidates"] = policies
    body["seeds"] = [b.get("parameters", {}).get("seed") for b in bodies]
    return body


def max_candidates(info: Any) -> int:
    """How many candidates a server takes in one ``/v1/traces`` request, from its ``/info``
    answer: 0 when it does not advertise ``trace_candidates`` (an older server).

    Examples
    --------
    >>> max_candidates({"kvdiv": {"trace_candidates": True, "max_candidates": 64}})
    64
    >>> max_candidates({"kvdiv": {}}), max_candidates("not json")
    (0, 0)
    """
    kvdiv = info.get("kvdiv") if isinstance(info, Mapping) else None
    if not isinstance(kvdiv, Mapping) or kvdiv.get("trace_candidates") is not True:
        return 0
    n = kvdiv.get("max_candidates")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


class CandidateSplitter:
    """Routes a multi-candidate response's lines to their candidates.

    Parameters
    ----------
    policies : sequence of str
        The candidates asked for.

    Examples
    --------
    >>> s = CandidateSplitter(["a", "b"])
    >>> s.route(b'{"type":"step","step":1,"candidate":"b"}')
    'b'
    >>> s.route(b'{"type":"header","candidate":{"policy":"a"}}')
    'a'
    """

    def __init__(self, policies: Sequence[str]) -> None:
        self.policies = set(policies)
        self.lines = 0

    def route(self, raw: bytes) -> str | None:
        """The policy a line belongs to; None for a blank line.

        Raises
        ------
        StreamError
            A line that does not parse within the stream limits, or that names no
            candidate or one not asked for (the whole response is then suspect).
        """
        if not raw.strip():
            return None
        self.lines += 1
        rec = parse_record(raw.rstrip(b"\n"), self.lines, STREAM_LIMITS)
        tag = rec.get("candidate")
        policy = tag.get("policy") if rec.get("type") == "header" and isinstance(tag, Mapping) else tag
        if not isinstance(policy, str) or policy not in self.policies:
            shown = json.dumps(policy)[:80]
            raise StreamError(f"line {self.lines}: {rec.get('type')!r} record names candidate {shown}, "
                              f"not one of the {len(self.policies)} asked for")
        return policy
