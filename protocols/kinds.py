"""The trace kinds of ``kvdiv.trace/1`` as data: which exist, which have a wire format.

Every package compares a trace's kind against these members rather than against a
bare string, so adding a kind (or a wire format for one) is an edit here plus the
kind's own builder, rules and estimator, not a hunt for string literals.

``Kind`` is a :class:`enum.StrEnum`: a member *is* its string (``Kind.COUPLED ==
"coupled"``), so datasets, headers and JSON keep plain strings and files written
before this module existed read unchanged.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["KINDS", "TRACE_KINDS", "WIRE_KINDS", "Kind"]


class Kind(StrEnum):
    """One trace kind (docs/contract.md, "Trace kinds")."""

    #: P and Q decoded together under the stepwise maximal coupling, one path per replicate.
    COUPLED = "coupled"
    #: A shared path from P with one coupled branch per replicate after its first mismatch.
    RESIDUAL = "residual"
    #: Paths sampled from P with the log-probabilities of P and Q at each sampled token.
    REFERENCE = "reference"
    #: Task scores of P's and Q's answers without their tokens (e.g. a leaderboard's predictions).
    ANSWERS = "answers"


#: Every kind a dataset may declare, as plain strings (for messages and choices).
KINDS: tuple[str, ...] = tuple(k.value for k in Kind)

#: Kinds with a streamed wire format (header, step, shared-step and branch, or
#: reference-step records, end); a server streams these on ``/v1/traces`` and the
#: collector collects them. Reference traces also enter through the converters.
WIRE_KINDS: tuple[str, ...] = (Kind.COUPLED.value, Kind.RESIDUAL.value, Kind.REFERENCE.value)

#: Kinds that carry tokens (a horizon, a vocabulary, the coupling); ``answers`` carries
#: only the scores of finished answers.
TRACE_KINDS: tuple[str, ...] = WIRE_KINDS
