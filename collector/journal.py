"""The collector's journal (docs/contract.md §2): one NDJSON file per (document, policy) request.

Layout of a run directory::

    manifest.json                    collection parameters (the resume contract)
    documents.jsonl                  the documents used (copied, hashed in the manifest)
    requests/<doc>--<policy>--<h>.ndjson        complete requests (raw wire lines)
    requests/<doc>--<policy>--<h>.ndjson.part   a request being written
    rounds/<k>/allocation.json       round k >= 1 of an adaptive collection: replicates per (doc, policy)
    rounds/<k>/requests/...          its requests, named as above

Guarantees, and why they hold:

- A request's raw wire lines are appended to ``.part`` as they arrive, flushed and
  fsynced, so a crash loses at most the request in flight.
- ``.ndjson`` exists only for a complete request: the collector read every line as it
  arrived (``protocols.StreamReader``: digest, order, shapes) and checked the header
  against the request (``collector.checks``) before the ``.part`` file is fsynced
  and renamed (atomic on POSIX), and the directory fsynced.
- A rerun restarts every request without a complete file (the ``.part`` is truncated),
  so an interrupted collection resumed equals an uninterrupted one. A complete file
  that no longer reads or checks out is set aside (``.ndjson.rejected-<time>``, never
  deleted) and recollected.
- Rounds never mix: round k's requests live in their own folder, and its allocation
  is written (atomically) before its first request and compared on every resume, so
  a resumed round asks for the same replicates with the same seeds
  (``collector.checks.derive_seed`` takes the round).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

from collector.errors import JournalError, ManifestMismatch

__all__ = [
    "ALLOCATION", "ALLOCATION_FORMAT", "DOCUMENTS", "MANIFEST", "MANIFEST_FORMAT", "REQUESTS", "ROUNDS", "Journal",
    "JournalError", "ManifestMismatch", "RequestWriter", "request_name",
]

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "kvdiv.collection/1"
REQUESTS = "requests"
ROUNDS = "rounds"
ALLOCATION = "allocation.json"
ALLOCATION_FORMAT = "kvdiv.round/1"
DOCUMENTS = "documents.jsonl"
#: Manifest ``params`` keys and the types a readable manifest holds.
PARAM_TYPES: dict[str, tuple[type, ...]] = {
    "policies": (list,), "kind": (str,), "replicates": (int,), "max_new_tokens": (int,), "window": (int,),
    "temperature": (int, float), "top_k": (int, type(None)), "top_p": (int, float, type(None)), "seed": (int,),
    "template": (str,), "docs_sha256": (str,), "reference": (str,),
}

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_FSYNC_EVERY_S = 1.0  # fsync per line would dominate fast tiny-model streams


# --------------------------------------------------------------------------- request files


def _slug(text: str, limit: int = 60) -> str:
    return _UNSAFE.sub("_", text).strip("_")[:limit] or "_"


def request_name(doc_id: str, policy: str) -> str:
    """File stem for a request: readable slugs plus a hash so that distinct keys never collide.

    Examples
    --------
    >>> request_name("doc 1", "snapkv@0.5").startswith("doc_1--snapkv_0.5--")
    True
    """
    key = hashlib.sha256(f"{doc_id}\0{policy}".encode()).hexdigest()[:12]
    return f"{_slug(doc_id)}--{_slug(policy)}--{key}"


def _fsync_dir(path: Path) -> None:
    # A rename is durable only once its directory entry is; not all platforms allow it.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class RequestWriter:
    """Appends one request's raw wire lines to its ``.part`` file; ``commit`` makes it complete."""

    def __init__(self, part: Path, final: Path) -> None:
        self.part, self.final = part, final
        self._fh: BinaryIO | None = open(part, "wb")  # "wb": a stale .part is restarted
        self._last_sync = time.monotonic()
        self.lines = 0

    def write(self, line: bytes) -> None:
        """Append one line (a newline is added if missing)."""
        if self._fh is None:
            raise JournalError(f"{self.part}: request already closed")
        self._fh.write(line if line.endswith(b"\n") else line + b"\n")
        self._fh.flush()
        self.lines += 1
        if time.monotonic() - self._last_sync > _FSYNC_EVERY_S:
            os.fsync(self._fh.fileno())
            self._last_sync = time.monotonic()

    def commit(self) -> Path:
        """Fsync the ``.part`` file and rename it into place (the caller has checked every line)."""
        self._close(sync=True)
        os.replace(self.part, self.final)
        _fsync_dir(self.final.parent)
        return self.final

    def abort(self) -> None:
        """Leave the request incomplete (the ``.part`` stays for inspection, restarted on rerun)."""
        self._close(sync=False)

    def _close(self, *, sync: bool) -> None:
        if self._fh is not None:
            if sync:
                self._fh.flush()
                os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None

    def __enter__(self) -> RequestWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


class Journal:
    """A run directory: manifest, documents and one file per (document, policy) request.

    Parameters
    ----------
    run_dir : path
        The run directory (``kvdiv collect --out``).
    round_index : int
        The round whose requests this journal reads and writes: 0 (the first or only
        round, ``requests/``) or k >= 1 (``rounds/<k>/requests/``). The manifest and
        documents are the run's, shared by every round.
    """

    def __init__(self, run_dir: str | os.PathLike[str], round_index: int = 0) -> None:
        self.dir = Path(run_dir)
        self.round_index = int(round_index)
        self.round_dir = self.dir / ROUNDS / str(self.round_index) if self.round_index else self.dir
        self.requests = self.round_dir / REQUESTS

    def for_round(self, round_index: int) -> Journal:
        """The same run's journal for another round."""
        return Journal(self.dir, round_index)

    # -- rounds
    def rounds(self) -> list[int]:
        """The later rounds (k >= 1) that have an allocation, in order."""
        root = self.dir / ROUNDS
        if not root.is_dir():
            return []
        return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and (p / ALLOCATION).exists())

    @property
    def allocation_path(self) -> Path:
        return self.round_dir / ALLOCATION

    def read_allocation(self) -> dict[str, Any] | None:
        """This round's allocation record, None when none is written (or for round 0).

        Returns
        -------
        dict or None
            ``{"format", "round", "replicates": {doc: {policy: R}}, "basis": {...}}``.

        Raises
        ------
        JournalError
            The file exists but is not a readable allocation of this round.
        """
        path = self.allocation_path
        if not self.round_index or not path.exists():
            return None
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, OSError) as exc:
            raise JournalError(f"{path}: cannot read the round's allocation ({exc})") from None
        problems = _allocation_problems(record, self.round_index)
        if problems:
            raise JournalError(f"{path}: not an allocation of round {self.round_index}: " + "; ".join(problems))
        return record

    def write_allocation(self, replicates: Mapping[str, Mapping[str, int]],
                         basis: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Write this round's allocation (atomic), or check it against the one already written.

        Parameters
        ----------
        replicates : mapping
            doc -> policy -> replicates this round asks for (0: no request).
        basis : mapping, optional
            Why: the target or budget, the metrics, the estimates it came from
            (recorded, not compared).

        Returns
        -------
        dict
            The allocation record.

        Raises
        ------
        ManifestMismatch
            The round was already allocated differently (a resume must not mix rounds).
        """
        if not self.round_index:
            raise JournalError("round 0 has no allocation: its replicates are the manifest's")
        wanted = {str(d): {str(p): int(r) for p, r in row.items()} for d, row in replicates.items()}
        old = self.read_allocation()
        if old is not None:
            if old["replicates"] != wanted:
                diffs = _allocation_diffs(old["replicates"], wanted)
                raise ManifestMismatch(f"{self.allocation_path}: round {self.round_index} was allocated "
                                       f"differently ({'; '.join(diffs[:5])}); resume with the run's own "
                                       "allocation, or collect into a new --out directory")
            return old
        record = {"format": ALLOCATION_FORMAT, "round": self.round_index, "replicates": wanted,
                  "basis": dict(basis or {}),
                  "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        _atomic_write(self.allocation_path, json.dumps(record, indent=1, sort_keys=True) + "\n")
        return record

    # -- requests
    def path(self, doc_id: str, policy: str) -> Path:
        """The complete request file of (doc_id, policy)."""
        return self.requests / f"{request_name(doc_id, policy)}.ndjson"

    def open_request(self, doc_id: str, policy: str) -> RequestWriter:
        """A writer for a new attempt of (doc_id, policy), restarting its ``.part`` file."""
        self.requests.mkdir(parents=True, exist_ok=True)
        final = self.path(doc_id, policy)
        return RequestWriter(final.with_name(final.name + ".part"), final)

    def read_lines(self, doc_id: str, policy: str) -> list[bytes]:
        """The raw lines of a complete request file."""
        with open(self.path(doc_id, policy), "rb") as fh:
            return fh.readlines()

    def set_aside(self, doc_id: str, policy: str) -> Path | None:
        """Rename a request file that cannot be trusted to ``<name>.rejected-<time>`` (kept, not deleted)."""
        path = self.path(doc_id, policy)
        if not path.exists():
            return None
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        target = path.with_name(f"{path.name}.rejected-{stamp}")
        n = 1
        while target.exists():
            n += 1
            target = path.with_name(f"{path.name}.rejected-{stamp}-{n}")
        os.replace(path, target)
        _fsync_dir(path.parent)
        return target

    # -- manifest
    @property
    def manifest_path(self) -> Path:
        return self.dir / MANIFEST

    def read_manifest(self) -> dict[str, Any] | None:
        """The manifest, None when there is none; :class:`JournalError` naming the problem if unreadable."""
        path = self.manifest_path
        if not path.exists():
            return None
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            raise JournalError(f"{path}: not UTF-8 text ({exc.reason})") from None
        except (ValueError, RecursionError) as exc:
            raise JournalError(f"{path}: not valid JSON ({exc}); restore it from a copy or collect into a new "
                               "--out directory") from None
        except OSError as exc:
            raise JournalError(f"{path}: cannot read ({exc.strerror or exc})") from None
        problems = _manifest_problems(manifest)
        if problems:
            raise JournalError(f"{path}: not a kvdiv collection manifest: " + "; ".join(problems))
        return manifest

    def write_manifest(self, manifest: Mapping[str, Any]) -> None:
        """Atomic write (temp + rename): a crash never leaves half a manifest."""
        _atomic_write(self.manifest_path, json.dumps(manifest, indent=2, sort_keys=True) + "\n")

    def start(self, params: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
        """Create the manifest, or check a resume against it.

        ``params`` decide the traces' values (policies, kind, T, R, W, sampling, seed,
        documents hash, template) and must match exactly on resume; ``extra``
        (servers, concurrency) may change between runs and is updated.
        """
        old = self.read_manifest()
        params = json.loads(json.dumps(dict(params)))  # normalise tuples etc. as stored
        if old is not None:
            diffs = _diff(old["params"], params)
            if diffs:
                raise ManifestMismatch(
                    f"{self.dir} holds a collection with different parameters:\n  "
                    + "\n  ".join(diffs)
                    + "\nResume with the original parameters, or collect into a new --out directory."
                )
        elif self.dir.exists() and any(self.dir.iterdir()):
            raise JournalError(f"{self.dir}: exists and is not a collection run (no {MANIFEST}); "
                               "choose a new or empty --out directory")
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        manifest = dict(old or {"format": MANIFEST_FORMAT, "created": now, "params": params})
        manifest.update({k: v for k, v in extra.items()}, updated=now)
        self.write_manifest(manifest)
        return manifest


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _allocation_problems(record: Any, round_index: int) -> list[str]:
    if not isinstance(record, dict) or record.get("format") != ALLOCATION_FORMAT:
        return [f"format is not {ALLOCATION_FORMAT!r}"]
    problems = [] if record.get("round") == round_index else [f"round is {record.get('round')!r}"]
    rows = record.get("replicates")
    if not isinstance(rows, dict) or not all(
            isinstance(row, dict) and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0
                                          for r in row.values()) for row in rows.values()):
        problems.append("'replicates' is not an object of doc -> policy -> non-negative integer")
    return problems


def _allocation_diffs(old: Mapping[str, Mapping[str, int]], new: Mapping[str, Mapping[str, int]]) -> list[str]:
    keys = sorted({(d, p) for rows in (old, new) for d, row in rows.items() for p in row})
    return [f"{d} × {p}: {old.get(d, {}).get(p, 0)} written, {new.get(d, {}).get(p, 0)} asked"
            for d, p in keys if old.get(d, {}).get(p, 0) != new.get(d, {}).get(p, 0)]


def _manifest_problems(manifest: Any) -> list[str]:
    if not isinstance(manifest, dict):
        return [f"a JSON {type(manifest).__name__}, not an object"]
    if manifest.get("format") != MANIFEST_FORMAT:
        return [f"format is {manifest.get('format')!r}, not {MANIFEST_FORMAT!r}"]
    params = manifest.get("params")
    if not isinstance(params, dict):
        return ["no 'params' object"]
    problems = [f"params.{key} is {params.get(key)!r}" for key, types in PARAM_TYPES.items()
                if not isinstance(params.get(key), types) or isinstance(params.get(key), bool)]
    if isinstance(params.get("policies"), list) and not all(isinstance(p, str) for p in params["policies"]):
        problems.append("params.policies holds a non-string")
    return problems


def _diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    return [f"{key}: manifest has {old.get(key)!r}, this run asks for {new.get(key)!r}"
            for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)]
