"""Step values kept on the device and read back to the host once every k steps.

A decoding step's records need host numbers (TV, tokens, flags per row), and reading
a device tensor on the host (``tolist``, ``item``, ``bool``) waits for every kernel
queued before it: one such wait per value per step kept a GPU idle between steps while
Python built the record. The loops instead hand each step's (rows,) tensors to a
:class:`Readback`, which keeps them on the device and copies them to the host in
**one** transfer every ``every`` steps (and at the end of a loop), then builds the
records in step order. Records thus come out in order, at most ``every − 1`` steps
late; cancellation is still checked every step (it reads a host flag only).

The same copy carries a :class:`FiniteGuard`'s flags: rows whose logits were NaN or
inf, caught on the device before anything sampled from them, end their request at
that readback with :class:`~gen_service.errors.NonFiniteLogits` naming the step, after
the records of the steps before it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gen_service.errors import NonFiniteLogits

__all__ = ["HOST_READS", "READBACK_EVERY", "FiniteGuard", "HostReads", "Readback"]

#: steps between host copies: one wait per 8 steps, records at most 7 steps late
READBACK_EVERY = 8


class FiniteGuard:
    """Non-finite logits caught on the device before anything samples from them.

    A NaN row is no law: the draw (:func:`gen_service.engine.coupling.categorical`) would
    return an arbitrary token and its TV would be NaN, and any sampler that checks its
    input on CUDA (``torch.multinomial``) raises a device-side assert, which ends the
    process's CUDA context and so every request in the batch. A loop passes each step's
    logits through the guard first (:meth:`__call__`): rows whose logits are not all
    finite (their sum is NaN or ±inf exactly then, barring finite logits summing past
    3e38, which are as unusable) are replaced by zeros, a uniform law that samples
    safely, and the count of such rows per side is kept **on the device**. Nothing is
    read on the host here: :meth:`take` hands the pending counts to the next host copy
    (:meth:`Readback.flush`, :meth:`gen_service.engine.branches.Branches.records`), and
    :meth:`failure` turns the host values into the error naming the first bad step.

    Parameters
    ----------
    device : torch.device
        Where the loop's logits are.

    Examples
    --------
    >>> guard = FiniteGuard(torch.device("cpu"))
    >>> p, q = guard(3, "step 3", torch.tensor([[0.0, 1.0], [float("nan"), 0.0]]), torch.zeros(2, 2))
    >>> p.tolist()
    [[0.0, 1.0], [0.0, 0.0]]
    >>> str(guard.failure(guard.take().tolist()))
    "non-finite logits (NaN or inf) at step 3 on P's side in 1 of 2 rows; the request ends here"
    """

    def __init__(self, device: torch.device):
        self.device = device
        #: per call since the last :meth:`take`: (step t or None, label, rows)
        self.calls: list[tuple[int | None, str, int]] = []
        self._counts: list[torch.Tensor] = []

    def __call__(self, t: int | None, label: str, *logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``logits`` (each (rows, V), one per side: P's, Q's) with their non-finite rows
        zeroed; ``t`` is the loop's step (None for a branch step), ``label`` names the
        step in the error."""
        bad = ~torch.isfinite(torch.stack([x.sum(-1) for x in logits]))   # (sides, rows)
        self._counts.append(bad.sum(1))
        self.calls.append((t, label, logits[0].shape[0]))
        return tuple(torch.where(b[:, None], 0.0, x) for b, x in zip(bad, logits, strict=True))

    @property
    def pending(self) -> bool:
        """Whether calls were made since the last :meth:`take`."""
        return bool(self._counts)

    def take(self) -> torch.Tensor:
        """The pending calls' bad-row counts, (calls × sides,) on the device, for the
        caller's host copy (:meth:`failure` reads them back in the same order)."""
        out = torch.cat(self._counts) if self._counts else torch.zeros(0, dtype=torch.long, device=self.device)
        self._counts = []
        return out

    def failure(self, counts: list[float]) -> NonFiniteLogits | None:
        """The error for the first call with a bad row, from :meth:`take`'s values on the
        host (None when every row was finite); the calls taken are forgotten."""
        calls, self.calls = self.calls, []
        sides = len(counts) // max(len(calls), 1)
        for i, (t, label, rows) in enumerate(calls):
            n = [int(c) for c in counts[i * sides:(i + 1) * sides]]
            if any(n):
                which = " and ".join(name for name, c in zip("PQ", n, strict=False) if c)
                return NonFiniteLogits(label, which, max(n), rows, t)
        return None


class Readback:
    """One loop's pending step values, read back together.

    Parameters
    ----------
    every : int
        Steps kept on the device before one host copy (1: every step, as a plain
        ``tolist`` per value would).
    build : callable
        ``build(t, *values)`` -> record, called with each step's values as host lists
        (floats: float64 holds every float32 TV and every token id exactly; tokens
        and flags are turned back to ``int``/``bool`` by ``build``).
    guard : FiniteGuard, optional
        The loop's guard, whose flags ride in the same host copy; a step flagged ends
        the loop (:meth:`emit`).

    Raises
    ------
    ValueError
        If ``every`` is below 1.

    Examples
    --------
    >>> rb = Readback(2, lambda t, tv, x: (t, tv, [int(v) for v in x]))
    >>> rb.add(1, torch.tensor([0.5]), torch.tensor([3]))
    []
    >>> rb.add(2, torch.tensor([0.25]), torch.tensor([4]))
    [(1, [0.5], [3]), (2, [0.25], [4])]
    """

    def __init__(self, every: int, build: Callable[..., Any], guard: FiniteGuard | None = None):
        if every < 1:
            raise ValueError(f"readback interval must be at least 1 step, got {every}")
        self.every, self.build, self.guard = every, build, guard
        self.pending: list[tuple[int, torch.Tensor]] = []
        #: set by :meth:`flush` when the guard flagged a step (raised by :meth:`emit`)
        self.failed: NonFiniteLogits | None = None

    def emit(self, t: int, *values: torch.Tensor, last: bool = False) -> Iterator[Any]:
        """:meth:`add` (and :meth:`flush` when ``last``) as the records to yield, then the
        guard's :class:`~gen_service.errors.NonFiniteLogits` if a step was flagged: the
        steps before it come out, the flagged one and later ones do not."""
        records = self.add(t, *values) + (self.flush() if last else [])
        return self._then_fail(records)

    def _then_fail(self, records: list[Any]) -> Iterator[Any]:
        yield from records
        if self.failed is not None:
            raise self.failed

    def add(self, t: int, *values: torch.Tensor) -> list[Any]:
        """Keep step ``t``'s (rows,) values; the records of every pending step once
        ``every`` are pending, else nothing."""
        self.pending.append((t, torch.stack([v.double() for v in values])))
        return self.flush() if len(self.pending) >= self.every else []

    def flush(self) -> list[Any]:
        """The pending steps' records, in step order, from one device-to-host copy."""
        if not self.pending:
            return []
        values = torch.stack([v for _, v in self.pending])   # (steps, values, rows)
        if self.guard is None:
            host = values.tolist()
        else:   # the guard's counts in the same copy
            flat = torch.cat([values.flatten(), self.guard.take().double()]).tolist()
            n, (steps, k, rows) = values.numel(), values.shape
            host = [[flat[(i * k + j) * rows:(i * k + j + 1) * rows] for j in range(k)] for i in range(steps)]
            self.failed = self.failed or self.guard.failure(flat[n:])
        bad = self.failed.t if self.failed is not None and self.failed.t is not None else None
        out = [self.build(t, *fields) for (t, _), fields in zip(self.pending, host, strict=True)
               if bad is None or t < bad]
        self.pending = []
        return out


#: the ``torch.Tensor`` methods that read a tensor's values on the host (on a GPU,
#: each waits for the queued kernels: a host synchronisation)
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


class HostReads:
    """Count host reads of tensors made by code under ``roots``, while inside.

    An instrument for tests and benchmarks on any device: on CPU a read costs no
    wait, so torch's own sync debug mode (``torch.cuda.set_sync_debug_mode``, CUDA
    only) cannot see them; this patches the :data:`HOST_READS` methods of
    ``torch.Tensor`` and counts each call whose caller's file lies under one of
    ``roots`` (e.g. the ``gen_service`` directory). Reads made inside torch's C++ code
    or by other libraries are not counted.

    Parameters
    ----------
    roots : sequence of str
        Directory prefixes of the calling files to count.

    Examples
    --------
    >>> import os
    >>> with HostReads([os.path.dirname(__file__)]) as reads:
    ...     _ = Readback(1, lambda t, v: v).add(1, torch.zeros(2))
    >>> reads.count
    1
    """

    def __init__(self, roots: Any):
        self.roots = tuple(os.path.abspath(r) + os.sep for r in roots)
        self.count = 0
        self.by_site: dict[str, int] = {}
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> HostReads:
        def wrap(name: str, method: Any) -> Any:
            def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                code = sys._getframe(1).f_code
                if code.co_filename.startswith(self.roots):
                    self.count += 1
                    site = f"{code.co_filename.rsplit('/', 1)[-1]}:{sys._getframe(1).f_lineno} {name}"
                    self.by_site[site] = self.by_site.get(site, 0) + 1
                return method(tensor, *args, **kwargs)
            return counted

        for name in HOST_READS:
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, wrap(name, self._saved[name]))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, method)
        self._saved = {}
