"""Pack a collection run: its complete requests into one validated ``kvdiv.trace/1`` dataset."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from collector.documents import Document, read_jsonl
from collector.journal import DOCUMENTS, Journal

__all__ = ["PackError", "missing_requests", "pack_run", "save_dataset"]


class PackError(RuntimeError):
    """A journal that cannot be packed as asked (missing requests, unreadable streams)."""


def missing_requests(journal: Journal, docs: Sequence[Document], policies: Sequence[str]) -> dict[str, list[str]]:
    """Document id -> policies without a complete request, for every incomplete document."""
    missing: dict[str, list[str]] = {}
    for doc in docs:
        lacking = [p for p in policies if not journal.is_complete(doc.id, p)]
        if lacking:
            missing[doc.id] = lacking
    return missing


def pack_run(run_dir: str | Path, *, drop_incomplete: bool = False, progress: bool = True) -> Any:
    """Assemble every complete request of a run into one validated dataset.

    Each request's stream becomes a one-doc one-policy dataset (``protocols.assemble``,
    which re-checks order, shapes and digest); they are combined along ``policy``
    (in the manifest's order) and then ``doc`` (in the documents file's order). A
    document lacking any policy is an error naming every gap, unless
    ``drop_incomplete`` leaves such documents out.
    """
    from tqdm.auto import tqdm

    import protocols

    journal = Journal(run_dir)
    manifest = journal.read_manifest()
    if manifest is None:
        raise PackError(f"{run_dir}: no {journal.manifest_path.name}; is this a `kvdiv collect --out` directory?")
    params = manifest["params"]
    policies: list[str] = params["policies"]
    docs = read_jsonl(journal.dir / DOCUMENTS)
    missing = missing_requests(journal, docs, policies)
    if missing and not drop_incomplete:
        raise PackError(_missing_message(missing, len(docs)))
    keep = [d for d in docs if d.id not in missing]
    if not keep:
        raise PackError(f"{run_dir}: no document has every policy complete\n" + _missing_message(missing, len(docs)))
    per_doc = []
    for doc in tqdm(keep, desc="pack", unit="doc", file=sys.stderr, disable=not progress):
        try:
            parts = [protocols.assemble(journal.read_lines(doc.id, p), doc=doc.id) for p in policies]
        except Exception as exc:  # name the request: a bad stream is otherwise anonymous
            raise PackError(f"{doc.id}: {exc}") from exc
        per_doc.append(protocols.combine(parts, dim="policy"))
    ds = protocols.combine(per_doc, dim="doc")
    ds.attrs.update(_collection_attrs(manifest))
    protocols.validate(ds)
    return ds


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


def save_dataset(ds: Any, path: str | Path) -> Path:
    """Save with protocols (``.nc`` or ``.zarr`` by suffix), replacing an older file atomically."""
    import protocols

    out = Path(path)
    if out.suffix not in (".nc", ".zarr"):
        raise PackError(f"{out}: the output must end in .nc or .zarr")
    out.parent.mkdir(parents=True, exist_ok=True)
    return protocols.save_traces(ds, out)  # writes a temporary sibling, then renames it over ``out``
