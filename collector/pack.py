"""Pack a collection run: its complete requests into one validated ``kvdiv.trace/1`` dataset.

Nothing is packed on trust. The manifest must be readable, the run's copy of the
documents must be the one it names (sha256 and count), and every request file is
read again (``protocols.StreamReader``: digest, order, shapes) and its header checked
against its (document, policy) slot and the run's parameters (``collector.checks``).
A file that fails is named, with its problem, and nothing is written; rerunning
``kvdiv collect`` sets such files aside and recollects them.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from collector.checks import RunLedger, audit_document
from collector.documents import Document, file_sha256, read_jsonl
from collector.errors import CollectorError, PackError
from collector.journal import DOCUMENTS, Journal

__all__ = ["PackError", "missing_requests", "pack_run", "save_dataset"]


def missing_requests(journal: Journal, docs: Sequence[Document], policies: Sequence[str]) -> dict[str, list[str]]:
    """Document id -> policies without a complete request file, for every incomplete document.

    Parameters
    ----------
    journal : Journal
        The run.
    docs : sequence of Document
        The run's documents.
    policies : sequence of str
        The run's policies.

    Returns
    -------
    dict
        Only documents lacking at least one file (existence only; :func:`pack_run`
        also checks each file that exists).
    """
    missing: dict[str, list[str]] = {}
    for doc in docs:
        lacking = [p for p in policies if not journal.path(doc.id, p).exists()]
        if lacking:
            missing[doc.id] = lacking
    return missing


def _manifest(journal: Journal) -> dict[str, Any]:
    try:
        manifest = journal.read_manifest()
    except CollectorError as exc:
        raise PackError(str(exc)) from None
    if manifest is None:
        raise PackError(f"{journal.dir}: no {journal.manifest_path.name}; is this a `kvdiv collect --out` directory?")
    return manifest


def _documents(journal: Journal, manifest: Mapping[str, Any]) -> list[Document]:
    """The run's documents, refused unless they are the ones the manifest names."""
    path = journal.dir / DOCUMENTS
    try:
        digest = file_sha256(path)
        docs = read_jsonl(path)
    except FileNotFoundError:
        raise PackError(f"{path}: missing; the run's copy of its documents is needed to pack it") from None
    except (OSError, ValueError) as exc:
        raise PackError(f"{path}: {exc}") from None
    want_sha, want_n = manifest["params"]["docs_sha256"], manifest.get("n_docs")
    if digest != want_sha or (want_n is not None and want_n != len(docs)):
        raise PackError(f"{path}: {len(docs)} documents with sha256 {digest[:12]}…, but the manifest records "
                        f"n_docs {want_n} with docs_sha256 {str(want_sha)[:12]}…; restore the documents file "
                        "the run was collected with")
    return docs


def pack_run(run_dir: str | Path, *, drop_incomplete: bool = False, progress: bool = True) -> Any:
    """Assemble every complete request of a run into one validated dataset.

    Each request's stream becomes a one-doc one-policy dataset
    (``protocols.assemble_stream``); they are combined along ``policy`` (in the
    manifest's order) and then ``doc`` (in the documents file's order).

    Parameters
    ----------
    run_dir : path
        The run directory (``kvdiv collect --out``).
    drop_incomplete : bool
        Leave out documents lacking a policy instead of failing.
    progress : bool
        Show a progress bar on stderr.

    Returns
    -------
    xarray.Dataset
        Validated ``kvdiv.trace/1`` traces with the collection's attrs.

    Raises
    ------
    PackError
        An unreadable manifest, documents that are not the run's, request files that
        cannot be trusted (each named with its problem), or missing requests (unless
        ``drop_incomplete``).
    """
    from tqdm.auto import tqdm

    import protocols

    journal = Journal(run_dir)
    manifest = _manifest(journal)
    params = manifest["params"]
    policies: list[str] = params["policies"]
    docs = _documents(journal, manifest)
    ledger = RunLedger(model=manifest.get("model"))
    per_doc, missing, refused = [], {}, []
    for doc in tqdm(docs, desc="pack", unit="doc", file=sys.stderr, disable=not progress):
        streams, rejected = audit_document(journal, doc.id, policies, params, ledger)
        refused += rejected.values()
        lacking = [p for p in policies if p not in streams]
        if lacking:
            missing[doc.id] = lacking
        elif not refused:  # once anything is refused nothing will be written: only check the rest
            per_doc.append(_assemble_doc(journal, doc.id, policies, streams))
    if refused:
        raise PackError(f"{len(refused)} request files in {journal.requests} cannot be trusted:\n  "
                        + "\n  ".join(refused[:20]) + (f"\n  ... and {len(refused) - 20} more" if len(refused) > 20
                                                        else "")
                        + "\nRerun the same `kvdiv collect` command: it sets them aside and recollects them.")
    if missing and not drop_incomplete:
        raise PackError(_missing_message(missing, len(docs)))
    if not per_doc:
        raise PackError(f"{run_dir}: no document has every policy complete\n" + _missing_message(missing, len(docs)))
    try:
        ds = protocols.combine(per_doc, dim="doc")
        ds.attrs.update(_collection_attrs(manifest))
        return protocols.validate(ds)
    except (protocols.CombineError, protocols.TraceValidationError) as exc:
        raise PackError(f"{run_dir}: the requests do not form one dataset: {exc}") from None


def _assemble_doc(journal: Journal, doc_id: str, policies: Sequence[str], streams: Mapping[str, Any]) -> Any:
    import protocols

    parts = []
    for policy in policies:
        try:
            parts.append(protocols.assemble_stream(streams[policy], doc=doc_id))
        except (protocols.StreamError, protocols.TraceValidationError) as exc:
            raise PackError(f"{journal.path(doc_id, policy).name}: {exc}") from None
    try:
        return protocols.combine(parts, dim="policy")
    except protocols.CombineError as exc:
        raise PackError(f"{doc_id}: its requests do not combine: {exc}") from None


def _missing_message(missing: Mapping[str, list[str]], n_docs: int) -> str:
    lines = [f"{len(missing)} of {n_docs} documents lack complete requests:"]
    lines += [f"  {doc}: {', '.join(pols)}" for doc, pols in list(missing.items())[:20]]
    if len(missing) > 20:
        lines.append(f"  ... and {len(missing) - 20} more")
    lines.append("Rerun the same `kvdiv collect` command to finish them (complete requests are kept), "
                 "or pack with --drop-incomplete to leave those documents out.")
    return "\n".join(lines)


def _collection_attrs(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """Dataset attrs recording how the traces were collected (netCDF-safe scalars)."""
    params = manifest["params"]
    return {
        "prompt_template": str(params["template"]),  # the name protocols.assemble uses
        "documents_sha256": str(params["docs_sha256"]),
        "collection_seed": int(params["seed"]),
        "collection": json.dumps(params, sort_keys=True),
    }


def save_dataset(ds: Any, path: str | Path, *, overwrite: bool = False) -> Path:
    """Save with protocols (``.nc`` or ``.zarr`` by suffix) through a temporary sibling and a rename.

    Parameters
    ----------
    ds : xarray.Dataset
        The packed traces.
    path : path
        ``*.nc`` or ``*.zarr``.
    overwrite : bool
        Replace an existing output, but only one that kvdiv wrote (``protocols.save_traces``).

    Returns
    -------
    Path
        ``path``.

    Raises
    ------
    PackError
        A wrong suffix, or an existing output that may not be replaced.
    """
    import protocols

    out = Path(path)
    if out.suffix not in (".nc", ".zarr"):
        raise PackError(f"{out}: the output must end in .nc or .zarr")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        return protocols.save_traces(ds, out, overwrite=overwrite)
    except (protocols.OutputExistsError, OSError) as exc:
        raise PackError(str(exc)) from None
