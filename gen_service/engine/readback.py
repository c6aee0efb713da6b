"""Step values kept on the device and read back to the host once every k steps.

A decoding step's records need host numbers (TV, tokens, flags per row), and reading
a device tensor on the host (``tolist``, ``item``, ``bool``) waits for every kernel
queued before it: one such wait per value per step kept a GPU idle between steps while
Python built the record. The loops instead hand each step's (rows,) tensors to a
:class:`Readback`, which keeps them on the device and copies them to the host in
**one** transfer every ``every`` steps (and at the end of a loop), then builds the
records in step order. Records thus come out in order, at most ``every − 1`` steps
late; cancellation is still checked every step (it reads a host flag only).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["HOST_READS", "READBACK_EVERY", "HostReads", "Readback"]

#: steps between host copies: one wait per 8 steps, records at most 7 steps late
READBACK_EVERY = 8


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

    def __init__(self, every: int, build: Callable[..., Any]):
        if every < 1:
            raise ValueError(f"readback interval must be at least 1 step, got {every}")
        self.every, self.build = every, build
        self.pending: list[tuple[int, torch.Tensor]] = []

    def add(self, t: int, *values: torch.Tensor) -> list[Any]:
        """Keep step ``t``'s (rows,) values; the records of every pending step once
        ``every`` are pending, else nothing."""
        self.pending.append((t, torch.stack([v.double() for v in values])))
        return self.flush() if len(self.pending) >= self.every else []

    def flush(self) -> list[Any]:
        """The pending steps' records, in step order, from one device-to-host copy."""
        if not self.pending:
            return []
        host = torch.stack([v for _, v in self.pending]).tolist()
        out = [self.build(t, *fields) for (t, _), fields in zip(self.pending, host, strict=True)]
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
