"""The scheduler: runs the forwards the decoding loops ask for (vLLM's split of deciding
from running: the loops decide what to feed, this decides how it runs).

A loop is a generator yielding records and, when it needs logits, a list of
:class:`Forward` (P's and Q's); it is sent their logits back. :func:`drive` runs one
loop's forwards one by one; :func:`drive_many` advances every candidate's loop to its
next forwards and runs them together. Both are a request's *steps* (:func:`steps`,
:func:`steps_many`: records, and an :class:`Ask` per decoding step) run by
:func:`run_steps`; the service's batch loop runs several requests' steps instead,
merging their asks into one :func:`run_forwards`. Forwards run together are: sides on
the shared prompt path (:func:`gen_service.attention.shared_cache.stackable`) stacked in one
batch, P rows with P rows and Q rows with Q rows, the two stacks fused into one forward where
:mod:`gen_service.engine.fusion` says so; any other side alone, exactly as alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from gen_service.attention.shared_cache import stackable
from gen_service.engine.fusion import fused
from gen_service.engine.jobs import CandidateDone, CandidateFailed
from gen_service.engine.sides import Forward
from gen_service.errors import Cancelled

__all__ = ["Ask", "Runner", "drive", "drive_many", "run_forwards", "run_steps", "steps", "steps_many"]

log = logging.getLogger("kvdiv.service")


@dataclass(frozen=True)
class Runner:
    """How forwards run: ``one`` runs a forward alone, ``stacked`` several shared-prompt
    forwards as one; ``batch_candidates`` stacks at all, ``fuse`` ("auto", "on", "off")
    fuses P's and Q's stacks, ``measured`` keeps "auto"'s timings per shape (shared with
    the engine, which reports them)."""

    one: Callable[[Forward], torch.Tensor]
    stacked: Callable[[list[Forward]], list[torch.Tensor]]
    device: torch.device
    batch_candidates: bool = True
    fuse: str = "auto"
    measured: dict[tuple[int, int, int], dict[str, Any]] = field(default_factory=dict)
    #: a group of one forward goes through ``stacked`` too (Engine.make_batch_invariant)
    invariant: bool = False


@dataclass(frozen=True)
class Ask:
    """The forwards a request's loops need for one step, keyed by candidate index (0 for
    a single-candidate request), each P's and Q's; answered with the same keys' logits.
    What a request's steps (:func:`steps`, :func:`steps_many`) yield to whoever runs
    them: :func:`run_steps` for the request alone, the service's batch loop
    (:mod:`gen_service.serving.batching`) for several requests' at once."""

    forwards: dict[int, list[Forward]]


def run_steps(steps: Iterator[Any], runner: Runner) -> Iterator[Any]:
    """Run one request's steps on their own: each :class:`Ask`'s forwards as it comes,
    every other item passed on."""
    answer = None
    while True:
        try:
            item = steps.send(answer)
        except StopIteration:
            return
        if isinstance(item, Ask):
            answer = run_forwards(item.forwards, runner)
        else:
            answer = None
            yield item


def steps(loop: Iterator[Any]) -> Iterator[Any]:
    """One decoding loop's records and its forwards as one-candidate :class:`Ask` each."""
    answer = None
    while True:
        try:
            item = loop.send(answer)
        except StopIteration:
            return
        if isinstance(item, list):
            answer = (yield Ask({0: item}))[0]
        else:
            answer = None
            yield item


def drive(loop: Iterator[Any], runner: Runner) -> Iterator[dict[str, Any]]:
    """Run one decoding loop on its own: each forward it asks for, one after the other."""
    return run_steps(steps(loop), runner)


def drive_many(policies: list[str], loops: list[Iterator[Any]], runner: Runner) -> Iterator[Any]:
    """Advance every candidate's loop to its next forwards, run them together, repeat
    (:func:`steps_many` run by :func:`run_steps`)."""
    return run_steps(steps_many(policies, loops), runner)


def steps_many(policies: list[str], loops: list[Iterator[Any]]) -> Iterator[Any]:
    """Advance every candidate's loop to its next forwards and ask for them together, repeat.
    Records come out tagged with their candidate; a candidate whose loop fails gives a
    :class:`CandidateFailed` and the others go on."""
    answers: list[Any] = [None] * len(loops)
    live = list(range(len(loops)))
    while live:
        asks: dict[int, list[Forward]] = {}
        for i in list(live):
            try:
                ask = yield from _advance(loops[i], answers[i], policies[i])
            except Cancelled:
                raise
            except Exception as exc:  # this candidate's own work failed: the others go on
                log.error("candidate %s failed while decoding", policies[i], exc_info=exc)
                live.remove(i)
                yield CandidateFailed(policies[i], exc)
                continue
            answers[i] = None
            if ask is None:
                live.remove(i)
                yield CandidateDone(policies[i])
            else:
                asks[i] = ask
        if asks:
            for i, logits in (yield Ask(asks)).items():
                answers[i] = logits


def _advance(loop: Iterator[Any], answer: Any, policy: str) -> Iterator[dict[str, Any]]:
    """Send ``answer``, pass the records on (tagged), return the next forwards asked for,
    or None once the loop has ended."""
    while True:
        try:
            item = loop.send(answer)
        except StopIteration:
            return None
        answer = None
        if isinstance(item, list):
            return item
        item["candidate"] = policy
        yield item


def run_forwards(asks: dict[Any, list[Forward]], runner: Runner) -> dict[Any, list[torch.Tensor]]:
    """The forwards every candidate asked for this round, stacked where their sides allow
    (keys: any hashable, a candidate's index or a request's and candidate's)."""
    out: dict[Any, list[Any]] = {i: [None] * len(fs) for i, fs in asks.items()}
    stack: dict[int, list[tuple[Any, int, Forward]]] = {}
    for i, fs in asks.items():
        for j, f in enumerate(fs):
            if runner.batch_candidates and stackable(f.side):
                stack.setdefault(j, []).append((i, j, f))   # j: 0 = P's forward, 1 = Q's
            else:
                out[i][j] = runner.one(f)
    groups = list(stack.values())
    if len(groups) == 2 and fused(groups, runner.fuse, runner.measured,
                                  lambda part: run_group(part, runner), runner.stacked, runner.device):
        groups = [groups[0] + groups[1]]
    for group in groups:
        for (i, j, _), logits in zip(group, run_group([f for _, _, f in group], runner), strict=True):
            out[i][j] = logits
    return out


def run_group(forwards: list[Forward], runner: Runner) -> list[torch.Tensor]:
    """Stacked forwards in one batch; a group of one runs as its own forward, unless the
    runner is ``invariant``: its numbers are then those of the one path it takes merged
    (the stacked cascade, the prompt padded to the pool's key blocks), alone or not
    (tests/test_batch_invariance.py)."""
    if len(forwards) == 1 and not runner.invariant:
        return [runner.one(forwards[0])]
    return runner.stacked(forwards)
