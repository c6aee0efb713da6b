"""The rows of an evaluation log: a JSONL file's lines or an iterable's records, each labelled
for error messages ('line N' / 'record N'). Read by every converter that takes such logs
(:mod:`protocols.converters`, :mod:`protocols.kvpress_results`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["log_rows"]


def log_rows(source: str | os.PathLike[str] | Iterable[Mapping[str, Any] | str | bytes]) -> Iterable[tuple[str, Any]]:
    """(row label, record) pairs; labels are 'line N' of a file or 'record N' of an iterable.

    Parameters
    ----------
    source : path or iterable
        A JSONL file (its non-blank lines, as bytes) or records (mappings, or JSON text).

    Returns
    -------
    iterable of (str, object)
        Each row's label and its raw record; blank lines are skipped.

    Raises
    ------
    FileNotFoundError
        If ``source`` is a path that does not exist.

    Examples
    --------
    >>> list(log_rows([{"a": 1}, "", '{"b": 2}']))
    [('record 1', {'a': 1}), ('line 3', '{"b": 2}')]
    """
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such evaluation log")
        with path.open("rb") as f:
            for n, line in enumerate(f, start=1):
                if line.strip():
                    yield f"line {n}", line
        return
    for n, rec in enumerate(source, start=1):
        if isinstance(rec, (str, bytes)) and not rec.strip():
            continue
        yield f"{'line' if isinstance(rec, (str, bytes)) else 'record'} {n}", rec
