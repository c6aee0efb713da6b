"""One response's streams and when each is finished (a response of one policy, or several
multiplexed, collector/grouped.py), and which stream failures are worth a retry."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from collector.errors import PermanentError, RetryableError
from collector.grouped import CandidateSplitter
from collector.jobs import Job
from collector.journal import Journal, RequestWriter
from protocols.stream import StreamError, StreamReader

__all__ = ["Exchange", "Stream", "stream_failure"]


@dataclass
class Stream:
    """One (document, policy) stream of a response: its request, its journal file and its reader."""

    job: Job
    writer: RequestWriter
    reader: StreamReader = field(default_factory=StreamReader)


class Exchange:
    """One response's streams, one per request sent, and how each ended (``ends``: policy -> None
    when complete, or its error).

    A response to one policy is that policy's stream alone: every line is its own (blank ones
    included, as its journal file has always kept them), its failure is the response's, and it
    completes when the response ends, so that a line after its ``end`` is still read and refused.
    A multi-candidate response multiplexes several (collector/grouped.py): each line goes to the
    candidate it names (a blank one to none), and each stream completes at its own ``end``, or
    fails alone; a stream's lines after it ended are dropped.
    """

    def __init__(self, jobs: Sequence[Job], journal: Journal, ends: dict[str, Exception | None]) -> None:
        self.streams = {job.policy: Stream(job, journal.open_request(job.doc.id, job.policy)) for job in jobs}
        self.shared = len(jobs) > 1
        self.splitter = CandidateSplitter(list(self.streams)) if self.shared else None
        # The caller's dict, so that the candidates already committed stay complete when the
        # response as a whole fails afterwards (a dropped connection, a stray line).
        self.ends = ends

    def route(self, raw: bytes) -> Stream | None:
        """The stream a line belongs to (None: a blank line, or a stream that has ended)."""
        if self.splitter is None:
            return next(iter(self.streams.values()))
        try:
            policy = self.splitter.route(raw)
        except StreamError as exc:   # a line for no candidate asked: nothing in this response is trusted
            raise RetryableError(str(exc)) from None
        return None if policy is None or policy in self.ends else self.streams[policy]

    @contextmanager
    def outcome(self, stream: Stream) -> Iterator[None]:
        """A stream's failure: the whole response's when it is the only stream, else that stream's end."""
        try:
            yield
        except (RetryableError, PermanentError) as exc:
            if not self.shared:
                raise
            self.ends[stream.job.policy] = exc

    def unended(self) -> list[Stream]:
        return [s for policy, s in self.streams.items() if policy not in self.ends]

    def close(self) -> None:
        for stream in self.streams.values():
            stream.writer.abort()   # nothing for the committed ones


def stream_failure(exc: StreamError) -> RetryableError | PermanentError:
    """A stream the reader refused: a server's validation error is permanent, the rest may pass next time."""
    if exc.reason == "failed" and (exc.record or {}).get("error_type") == "validation":
        return PermanentError(str(exc))
    return RetryableError(str(exc))
