"""The collector's journal (docs/contract.md §2): one NDJSON file per (document, policy) request.

Layout of a run directory::

    manifest.json                    collection parameters (the resume contract)
    documents.jsonl                  the documents used (copied, hashed in the manifest)
    requests/<doc>--<policy>--<h>.ndjson        complete requests (raw wire lines)
    requests/<doc>--<policy>--<h>.ndjson.part   a request being written

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
    "DOCUMENTS", "MANIFEST", "MANIFEST_FORMAT", "REQUESTS", "Journal", "JournalError", "ManifestMismatch",
    "RequestWriter", "request_name",
]

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "kvdiv.collection/1"
REQUESTS = "requests"
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
    """

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(run_dir)
        self.requests = self.dir / REQUESTS

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
