"""The collector's journal (docs/contract.md §2): one NDJSON file per (document, policy) request.

Layout of a run directory::

    manifest.json                    collection parameters (the resume contract)
    documents.jsonl                  the documents used (copied, hashed in the manifest)
    requests/<doc>--<policy>--<h>.ndjson        complete requests (raw wire lines)
    requests/<doc>--<policy>--<h>.ndjson.part   a request being written

Guarantees, and why they hold:

- A request's raw wire lines are appended to ``.part`` as they arrive, flushed and
  fsynced, so a crash loses at most the request in flight.
- ``.ndjson`` exists only for a complete request: the ``end`` record is present and
  its sha256 matches the bytes of every preceding line. The ``.part`` file is
  verified, fsynced and then renamed (atomic on POSIX), and the directory fsynced.
- A rerun restarts every request without a complete file (the ``.part`` is truncated),
  so an interrupted collection resumed equals an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "kvdiv.collection/1"
REQUESTS = "requests"
DOCUMENTS = "documents.jsonl"

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_FSYNC_EVERY_S = 1.0  # fsync per line would dominate fast tiny-model streams


class JournalError(RuntimeError):
    """A journal stream that is incomplete, altered, or failed on the server."""


class ManifestMismatch(RuntimeError):
    """A resume asked for parameters that differ from the run's manifest."""


# --------------------------------------------------------------------------- stream checks


def verify_stream(lines: Iterable[bytes]) -> dict[str, Any]:
    """Check one request's raw lines: header first, ``end`` last, digest matching.

    Returns the header record. Raises :class:`JournalError` for an error record,
    a missing ``end`` (truncation) or a digest that does not match (alteration).
    """
    digest = hashlib.sha256()
    header: dict[str, Any] | None = None
    end: dict[str, Any] | None = None
    for raw in lines:
        if end is not None:
            raise JournalError("data after the end record")
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise JournalError(f"line is not JSON: {raw[:80]!r}") from None
        kind = record.get("type") if isinstance(record, dict) else None
        if kind == "error":
            raise JournalError(f"server error ({record.get('error_type')}): {record.get('error')}")
        if header is None and kind != "header":
            raise JournalError(f"first record is {kind!r}, not a header")
        if kind == "header":
            header = record
        if kind == "end":
            end = record
        else:
            digest.update(raw if raw.endswith(b"\n") else raw + b"\n")
    if header is None or end is None:
        raise JournalError("stream ended before its end record (truncated)")
    if end.get("sha256") != digest.hexdigest():
        raise JournalError("sha256 of the stream does not match its end record")
    return header


# --------------------------------------------------------------------------- request files


def _slug(text: str, limit: int = 60) -> str:
    return _UNSAFE.sub("_", text).strip("_")[:limit] or "_"


def request_name(doc_id: str, policy: str) -> str:
    """File stem for a request: readable slugs plus a hash so that distinct keys never collide."""
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
        assert self._fh is not None, "request already closed"
        self._fh.write(line if line.endswith(b"\n") else line + b"\n")
        self._fh.flush()
        self.lines += 1
        if time.monotonic() - self._last_sync > _FSYNC_EVERY_S:
            os.fsync(self._fh.fileno())
            self._last_sync = time.monotonic()

    def commit(self, check: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Verify the whole file, fsync it and rename it into place; returns its header.

        ``check(header)`` runs after the digest verifies and before the rename; if it
        raises, the request stays incomplete.
        """
        self._close(sync=True)
        with open(self.part, "rb") as fh:
            header = verify_stream(fh)
        if check is not None:
            check(header)
        os.replace(self.part, self.final)
        _fsync_dir(self.final.parent)
        return header

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
    """A run directory: manifest, documents and one file per (document, policy) request."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(run_dir)
        self.requests = self.dir / REQUESTS

    # -- requests
    def path(self, doc_id: str, policy: str) -> Path:
        return self.requests / f"{request_name(doc_id, policy)}.ndjson"

    def is_complete(self, doc_id: str, policy: str) -> bool:
        """Complete means the file exists and verifies (end present, digest matching).

        Renaming happens only after verification, so existence nearly suffices; the
        re-check also catches a file damaged or edited after the run.
        """
        path = self.path(doc_id, policy)
        if not path.exists():
            return False
        try:
            with open(path, "rb") as fh:
                verify_stream(fh)
        except JournalError:
            return False
        return True

    def open_request(self, doc_id: str, policy: str) -> RequestWriter:
        self.requests.mkdir(parents=True, exist_ok=True)
        final = self.path(doc_id, policy)
        return RequestWriter(final.with_name(final.name + ".part"), final)

    def read_lines(self, doc_id: str, policy: str) -> list[bytes]:
        with open(self.path(doc_id, policy), "rb") as fh:
            return fh.readlines()

    # -- manifest
    @property
    def manifest_path(self) -> Path:
        return self.dir / MANIFEST

    def read_manifest(self) -> dict[str, Any] | None:
        if not self.manifest_path.exists():
            return None
        return json.loads(self.manifest_path.read_text(encoding="utf-8"))

    def write_manifest(self, manifest: Mapping[str, Any]) -> None:
        """Atomic write (temp + rename): a crash never leaves half a manifest."""
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.manifest_path.with_name(MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, self.manifest_path)

    def start(self, params: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
        """Create the manifest, or check a resume against it.

        ``params`` decide the traces' values (policies, kind, T, R, W, sampling, seed,
        documents hash, template) and must match exactly on resume; ``extra``
        (servers, concurrency) may change between runs and is updated.
        """
        old = self.read_manifest()
        params = json.loads(json.dumps(dict(params)))  # normalise tuples etc. as stored
        if old is not None:
            diffs = _diff(old.get("params", {}), params)
            if diffs:
                raise ManifestMismatch(
                    f"{self.dir} holds a collection with different parameters:\n  "
                    + "\n  ".join(diffs)
                    + "\nResume with the original parameters, or collect into a new --out directory."
                )
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        manifest = dict(old or {"format": MANIFEST_FORMAT, "created": now, "params": params})
        manifest.update({k: v for k, v in extra.items()}, updated=now)
        self.write_manifest(manifest)
        return manifest


def _diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    return [f"{key}: manifest has {old.get(key)!r}, this run asks for {new.get(key)!r}"
            for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)]
