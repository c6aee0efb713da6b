"""Pack a collection run: its complete requests into one validated ``kvdiv.trace/1`` dataset.

:func:`pack_to` (what ``kvdiv pack`` runs) writes the traces file document by
document through ``protocols.TraceStoreWriter``, so packing holds one document in
memory, never the whole dataset, and ``append=True`` adds the documents collected
since to a file packed earlier. :func:`pack_run` returns the whole dataset in memory
(small runs, tests, the demo).

Nothing is packed on trust. The manifest must be readable, the run's copy of the
documents must be the one it names (sha256 and count), and every request file is
read again (``protocols.StreamReader``: digest, order, shapes) and its header checked
against its (document, policy) slot and the run's parameters (``collector.checks``).
A file that fails is named, with its problem, and nothing is written; rerunning
``kvdiv collect`` sets such files aside and recollects them.

An adaptive collection's later rounds (``rounds/<k>/``) are packed with round 0 along
``replicate``, with a ``round`` coordinate (``collector.rounds``).

Traces are packed together only when their numerics agree: every header's
:data:`NUMERICS` fields (weights dtype, fused or separate P+Q forwards, the fusion
mode, the device type; docs/contract.md §3) must be the same, since a divergence
measured under one set of numerics is not comparable with another's noise floor.
A mix is refused naming the requests and fields that differ, unless
``allow_mixed_numerics`` (``kvdiv pack --allow-mixed-numerics``). The dataset records
them in the ``numerics`` attribute (JSON; ``"mixed"`` when allowed to differ) and,
per (document, policy), in ``header_extra``. A run collected with ``--control`` gets
the attribute ``control_policy = "full"``.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from collector.answers import answer_variables_for, has_answers
from collector.checks import RunLedger, audit_document
from collector.documents import Document, file_sha256, read_jsonl
from collector.errors import CollectorError, PackError
from collector.journal import DOCUMENTS, Journal
from collector.rounds import RoundLayout, stack_rounds

__all__ = ["NUMERICS", "PackError", "PackResult", "missing_requests", "numerics_of", "pack_run", "pack_to",
           "save_dataset"]

#: The header fields that decide a trace's floating-point numerics; pack refuses a mix.
NUMERICS: tuple[str, ...] = ("dtype", "fused", "fuse", "device")


def numerics_of(header: Mapping[str, Any]) -> dict[str, Any]:
    """A header's :data:`NUMERICS` fields (absent ones as None)."""
    return {k: header.get(k) for k in NUMERICS}


class _NumericsCheck:
    """The first request seen with each set of numerics; a second set is refused (unless allowed)."""

    def __init__(self, allow_mixed: bool) -> None:
        self.allow_mixed = allow_mixed
        self.seen: dict[str, tuple[str, dict[str, Any]]] = {}   # JSON of numerics -> (first request, numerics)

    def add(self, where: str, header: Mapping[str, Any]) -> None:
        num = numerics_of(header)
        key = json.dumps(num, sort_keys=True)
        if key in self.seen:
            return
        self.seen[key] = (where, num)
        if len(self.seen) > 1 and not self.allow_mixed:
            (first, a), (second, b) = list(self.seen.values())[:2]
            fields = ", ".join(f"{k}: {a[k]!r} in {first} vs {b[k]!r} in {second}" for k in NUMERICS if a[k] != b[k])
            raise PackError(f"the traces' numerics differ ({fields}); divergences computed under different "
                            "numerics are not comparable (docs/collector.md). Collect again with one server "
                            "setting (e.g. `kvdiv serve --fuse off`), or pass --allow-mixed-numerics")

    def attr(self) -> str:
        """The dataset's ``numerics`` attribute: the one set (JSON), or ``"mixed"`` when allowed to differ
        (the same in every document's piece, whatever the later documents hold)."""
        return "mixed" if self.allow_mixed else next(iter(self.seen), "{}")


def missing_requests(journal: Journal, docs: Sequence[Document], policies: Sequence[str],
                     layout: RoundLayout | None = None) -> dict[str, list[str]]:
    """Document id -> policies without a complete request file, for every incomplete document.

    Parameters
    ----------
    journal : Journal
        The run.
    docs : sequence of Document
        The run's documents.
    policies : sequence of str
        The run's policies.
    layout : RoundLayout, optional
        The run's rounds: the requests each later round asked are looked for too
        (named ``policy (round k)``).

    Returns
    -------
    dict
        Only documents lacking at least one file (existence only; :func:`pack_run`
        also checks each file that exists).
    """
    missing: dict[str, list[str]] = {}
    rounds = layout.rounds if layout is not None else (0,)
    for doc in docs:
        lacking = [p if k == 0 else f"{p} (round {k})" for k in rounds for p in policies
                   if (k == 0 or layout.asked(k, doc.id, p) > 0)
                   and not journal.for_round(k).path(doc.id, p).exists()]
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


def pack_run(run_dir: str | Path, *, drop_incomplete: bool = False, progress: bool = True,
             allow_mixed_numerics: bool = False, drop_policies: Sequence[str] = ()) -> Any:
    """Assemble every complete request of a run into one validated dataset, in memory.

    Each request's stream becomes a one-doc one-policy dataset
    (``protocols.assemble_stream``); they are combined along ``policy`` (in the
    manifest's order) and then ``doc`` (in the documents file's order). For runs that
    do not fit in memory, :func:`pack_to` writes the same documents one by one.

    Parameters
    ----------
    run_dir : path
        The run directory (``kvdiv collect --out``).
    drop_incomplete : bool
        Leave out documents lacking a policy instead of failing.
    progress : bool
        Show a progress bar on stderr.
    allow_mixed_numerics : bool
        Pack requests whose numerics (:data:`NUMERICS`) differ instead of refusing them.
    drop_policies : sequence of str
        Policies of the run to leave out (e.g. one the server refused by design): their
        request files are neither required nor read, and the dataset's
        ``dropped_policies`` attribute (a JSON list) names them.

    Returns
    -------
    xarray.Dataset
        Validated ``kvdiv.trace/1`` traces with the collection's attrs.

    Raises
    ------
    PackError
        An unreadable manifest, documents that are not the run's, request files that
        cannot be trusted (each named with its problem), missing requests (unless
        ``drop_incomplete``), or a policy to drop that the run does not have.
    """
    import protocols

    run = _Run(run_dir, allow_mixed_numerics=allow_mixed_numerics, drop_policies=drop_policies)
    per_doc = list(run.pieces(drop_incomplete=drop_incomplete, progress=progress))
    try:
        ds = protocols.combine(per_doc, dim="doc")
        return protocols.validate(ds)
    except (protocols.CombineError, protocols.TraceValidationError) as exc:
        raise PackError(f"{run_dir}: the requests do not form one dataset: {exc}") from None


class _Run:
    """A run to pack: its manifest, checked documents, and its requests read back one document at a time."""

    def __init__(self, run_dir: str | Path, allow_mixed_numerics: bool = False,
                 drop_policies: Sequence[str] = ()) -> None:
        self.dir = Path(run_dir)
        self.numerics = _NumericsCheck(allow_mixed_numerics)
        self.journal = Journal(run_dir)
        self.manifest = _manifest(self.journal)
        self.params = self.manifest["params"]
        self.dropped_policies = _policies_to_drop(self.journal, self.params["policies"], drop_policies)
        self.policies: list[str] = [p for p in self.params["policies"] if p not in self.dropped_policies]
        self.docs = _documents(self.journal, self.manifest)
        try:
            self.layout = RoundLayout.from_journal(self.journal, self.params)
        except CollectorError as exc:
            raise PackError(str(exc)) from None
        self.attrs = _collection_attrs(self.manifest, self.layout)
        if self.dropped_policies:
            self.attrs["dropped_policies"] = json.dumps(self.dropped_policies)
            if self.attrs.get("control_policy") in self.dropped_policies:
                del self.attrs["control_policy"]
        # task answers (collector.answers): a coupled run's round 0, when the documents carry them
        self.answers = has_answers(self.docs) and self.params.get("kind") == "coupled" and not self.layout.adaptive

    def _answers(self, doc: Document, n_rep: int) -> dict[str, Any]:
        """One document's answer variables; a document without answers gets unscored ones (NaN, "")."""
        if "answers" in doc.meta:
            return answer_variables_for(self.journal, doc, self.policies, n_rep)
        import numpy as np

        from protocols import answer_variables

        shape = (1, len(self.policies), n_rep)
        return answer_variables(*shape, x_score=np.full(shape, np.nan), y_score=np.full(shape, np.nan),
                                x_text=np.full(shape, "", dtype=object), y_text=np.full(shape, "", dtype=object),
                                x_answer_start=np.full(shape, -1), answers=[[]], scorer=[""], task=[""],
                                needle_depth=[np.nan])

    def pieces(self, *, drop_incomplete: bool, progress: bool, skip: Collection[str] = ()) -> Iterator[Any]:
        """One checked, assembled dataset per complete document (in file order), each with the run's attrs.

        Missing request files are found (by name) before any work, so a gap fails fast.
        A file that cannot be trusted stops the pieces but not the checking: every such
        file is named in the :class:`PackError` raised after the last document.
        """
        from tqdm.auto import tqdm

        docs = [doc for doc in self.docs if doc.id not in skip]
        missing = missing_requests(self.journal, docs, self.policies, self.layout)
        if missing and not drop_incomplete:
            raise PackError(_missing_message(missing, len(docs)))
        self.dropped = list(missing)
        ledger = RunLedger(model=self.manifest.get("model"))
        refused: list[str] = []
        yielded = 0
        for doc in tqdm(docs, desc="pack", unit="doc", file=sys.stderr, disable=not progress):
            streams, rejected = self._audit(doc.id, ledger)
            refused += rejected
            if refused or sum(map(len, streams.values())) < self._asked(doc.id):
                continue  # once anything is refused nothing will be written: only check the rest
            for k, by_policy in streams.items():
                for policy, stream in by_policy.items():
                    self.numerics.add(f"{doc.id} × {policy}" + (f" (round {k})" if k else ""), stream.header)
            piece = _assemble_doc(self.journal, doc.id, self.policies, streams, self.layout)
            if self.answers:
                piece = piece.assign(self._answers(doc, piece.sizes["replicate"]))
            piece.attrs.update(self.attrs)
            piece.attrs["numerics"] = self.numerics.attr()
            yielded += 1
            yield piece
        if refused:
            raise PackError(_refused_message(refused, self.journal))
        if not yielded and not skip:
            raise PackError(f"{self.dir}: no document has every policy complete\n"
                            + _missing_message(missing, len(docs)))


    def _asked(self, doc_id: str) -> int:
        """Requests the run asked of one document, over every round."""
        return sum(k == 0 or self.layout.asked(k, doc_id, p) > 0 for k in self.layout.rounds for p in self.policies)

    def _audit(self, doc_id: str, ledger: RunLedger) -> tuple[dict[int, dict[str, Any]], list[str]]:
        """Every round's checked streams of one document (round -> policy -> stream) and the refusals."""
        streams: dict[int, dict[str, Any]] = {}
        refused: list[str] = []
        for k in self.layout.rounds:
            asked = [p for p in self.policies if k == 0 or self.layout.asked(k, doc_id, p) > 0]
            streams[k], rejected = audit_document(self.journal.for_round(k), doc_id, asked,
                                                  self.layout.round_params(k), ledger)
            refused += [problem if k == 0 else f"round {k}: {problem}" for problem in rejected.values()]
        return streams, refused


@dataclass(frozen=True)
class PackResult:
    """What :func:`pack_to` wrote.

    Attributes
    ----------
    path : Path
        The traces file.
    written : int
        Documents this call wrote.
    kept : int
        Documents the file already held (``append``).
    dropped : tuple of str
        Incomplete documents left out (``drop_incomplete``).
    policies : tuple of str
        The policies, in the file's order.
    dropped_policies : tuple of str
        The run's policies left out (``drop_policies``).
    """

    path: Path
    written: int
    kept: int
    dropped: tuple[str, ...]
    policies: tuple[str, ...]
    dropped_policies: tuple[str, ...] = ()

    @property
    def total(self) -> int:
        """Documents in the file now."""
        return self.written + self.kept

    def summary(self) -> str:
        """One line for the command line."""
        text = f"{self.path}: {self.total} documents × {len(self.policies)} policies"
        if self.kept:
            text += f" ({self.written} appended to {self.kept})"
        if self.dropped:
            text += f"; {len(self.dropped)} incomplete documents left out"
        if self.dropped_policies:
            text += f"; policies left out: {', '.join(self.dropped_policies)}"
        return text


def pack_to(run_dir: str | Path, out: str | Path, *, append: bool = False, overwrite: bool = False,
            drop_incomplete: bool = False, batch_mib: float = 4.0, progress: bool = True,
            allow_mixed_numerics: bool = False, drop_policies: Sequence[str] = ()) -> PackResult:
    """Pack a run into a ``.zarr`` or ``.nc`` traces file, document by document, in bounded memory.

    Every request file is checked as in :func:`pack_run`; each complete document is
    assembled, validated and appended (``protocols.TraceStoreWriter``), a few at a
    time (about ``batch_mib`` of traces, at least one document), so memory holds a
    batch, never the whole dataset. The file appears under
    its name only when every document is written: a file that cannot be trusted, a
    gap, or an interruption leaves no new file (and, with ``append``, the documents
    that were there).

    Parameters
    ----------
    run_dir : path
        The run directory (``kvdiv collect --out``).
    out : path
        ``*.zarr`` or ``*.nc``.
    append : bool
        Add the run's documents that ``out`` does not hold yet to it. ``out`` must
        have been packed from the same collection (its ``collection`` attribute).
    overwrite : bool
        Replace an existing ``out`` (only a traces file kvdiv wrote).
    drop_incomplete : bool
        Leave out documents lacking a policy instead of failing.
    batch_mib : float
        Documents are written in batches of about this many MiB (at least one
        document): fewer, larger writes are faster; one document at a time is the
        least memory.
    progress : bool
        Show a progress bar on stderr.
    allow_mixed_numerics, drop_policies
        As :func:`pack_run`. What was left out (policies and incomplete documents) is
        also recorded in the run's manifest, under ``packs`` (one entry per file written).

    Returns
    -------
    PackResult
        Documents written, kept and left out.

    Raises
    ------
    PackError
        As :func:`pack_run`; also an ``out`` that exists (without ``overwrite`` or
        ``append``), is missing (``append``), or holds another collection.

    Examples
    --------
    >>> pack_to("runs/study", "runs/study/traces.zarr").summary()            # doctest: +SKIP
    'runs/study/traces.zarr: 200 documents × 4 policies'
    >>> pack_to("runs/study", "runs/study/traces.zarr", append=True).written  # doctest: +SKIP
    40
    """
    out = Path(out)
    if not append:  # an output that may not be replaced is refused before any reading
        _check_new_output(out, overwrite)
    run = _Run(run_dir, allow_mixed_numerics=allow_mixed_numerics, drop_policies=drop_policies)
    kept = _existing_documents(out, run) if append else set()
    pieces = run.pieces(drop_incomplete=drop_incomplete, progress=progress, skip=kept)
    first = next(pieces, None)  # checks and gaps fail here, before any file is touched
    if first is not None and append:
        _check_appended_numerics(out, run, first.attrs.get("numerics"), allow_mixed_numerics)
    written = 0
    if first is not None:
        try:
            with _open_writer(out, append=append, overwrite=overwrite) as writer:
                for batch in _batched(itertools.chain([first], pieces), batch_mib * 2**20):
                    _write(writer, batch, out)
                    written += sum(piece.sizes["doc"] for piece in batch)
        except (ValueError, OSError) as exc:  # finishing the file (close): the writer has rolled back
            raise PackError(_named(out, exc)) from None
    result = PackResult(out, written, len(kept), tuple(run.dropped), tuple(run.policies),
                        tuple(run.dropped_policies))
    if written:
        _record_pack(run, result)
    return result


def _policies_to_drop(journal: Journal, policies: Sequence[str], drop: Sequence[str]) -> list[str]:
    """The policies to leave out, checked against the run's (in the run's order)."""
    unknown = [p for p in drop if p not in policies]
    if unknown:
        raise PackError(f"--drop-policy {', '.join(unknown)}: not a policy of the run in {journal.dir} "
                        f"(its policies: {', '.join(policies)})")
    if set(policies) <= set(drop):
        raise PackError(f"--drop-policy leaves none of the run's policies ({', '.join(policies)}) to pack")
    return [p for p in policies if p in drop]


def _record_pack(run: _Run, result: PackResult) -> None:
    """Add what a pack wrote and left out to the run's manifest (``packs``, newest last)."""
    manifest = run.journal.read_manifest() or run.manifest   # re-read: a resumed collection may have updated it
    entry = {"out": str(result.path), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "documents": result.total, "policies": list(result.policies),
             "dropped_policies": list(result.dropped_policies), "dropped_documents": list(result.dropped)}
    manifest["packs"] = [*manifest.get("packs", []), entry]
    try:
        run.journal.write_manifest(manifest)
    except OSError as exc:   # a read-only run directory: the dataset's attrs still say what was left out
        print(f"note: could not record the pack in {run.journal.manifest_path}: {exc.strerror or exc}",
              file=sys.stderr)


def _batched(pieces: Iterator[Any], max_bytes: float) -> Iterator[list[Any]]:
    """Consecutive pieces, grouped until a group holds ``max_bytes`` (each group has at least one)."""
    batch: list[Any] = []
    size = 0
    for piece in pieces:
        batch.append(piece)
        size += piece.nbytes
        if size >= max_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _open_writer(out: Path, *, append: bool, overwrite: bool) -> Any:
    """The one place packing creates its writer: ``protocols.TraceStoreWriter``."""
    import protocols

    try:
        return protocols.TraceStoreWriter(out, append=append, overwrite=overwrite)
    except (ValueError, OSError) as exc:  # an output that may not be replaced, a store that cannot be appended to
        raise PackError(_named(out, exc)) from None


def _named(out: Path, exc: BaseException) -> str:
    return str(exc) if str(out) in str(exc) else f"{out}: {exc}"


def _write(writer: Any, batch: list[Any], out: Path) -> None:
    import protocols

    piece = batch[0] if len(batch) == 1 else protocols.combine(batch, dim="doc")
    try:
        writer.append(piece)
    except (protocols.TraceValidationError, ValueError) as exc:  # StoreError is a ValueError
        docs = ", ".join(str(d) for d in piece["doc"].values[:3])
        raise PackError(f"{out}: cannot add {docs}: {exc}") from None


def _check_new_output(out: Path, overwrite: bool) -> None:
    if out.suffix not in (".nc", ".zarr"):
        raise PackError(f"{out}: the output must end in .nc or .zarr")
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise PackError(f"{out}: exists; pass --overwrite to replace a kvdiv traces file, or --append to add "
                        "documents to it")


def _existing_documents(out: Path, run: _Run) -> set[str]:
    """The documents an ``append`` target holds, after checking it was packed from this collection."""
    import protocols

    if not out.exists():
        raise PackError(f"{out}: no traces file to append to; pack without --append first")
    try:
        existing = protocols.open_traces(out, validate=False, chunks=1)  # lazy: ids and attrs only
    except (ValueError, OSError) as exc:
        raise PackError(f"{out}: cannot be read as a traces file: {exc}") from None
    try:
        ids = {str(d) for d in existing["doc"].values} if "doc" in existing.coords else set()
        theirs = existing.attrs.get("collection")
        run.existing_numerics = existing.attrs.get("numerics")
    finally:
        existing.close()
    if not isinstance(theirs, str) or not ids:
        raise PackError(f"{out}: has no 'collection' attribute (not written by `kvdiv pack`); pack into a new file")
    ours = run.attrs["collection"]
    if theirs != ours:
        diffs = _param_diffs(json.loads(theirs), json.loads(ours))
        raise PackError(f"{out} holds another collection's traces ({'; '.join(diffs) or 'different parameters'}); "
                        "--append adds documents of the run it was packed from only")
    return ids


def _check_appended_numerics(out: Path, run: _Run, ours: Any, allow_mixed: bool) -> None:
    """Documents appended to a file packed earlier must have its numerics (unless allowed to mix)."""
    theirs = getattr(run, "existing_numerics", None)
    if allow_mixed or theirs is None or theirs == ours:
        return
    raise PackError(f"{out} holds traces with numerics {theirs}, the documents to append {ours}; divergences "
                    "under different numerics are not comparable. Pack into a new file, or pass "
                    "--allow-mixed-numerics")


def _param_diffs(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    return [f"{key}: the file has {old.get(key)!r}, the run {new.get(key)!r}"
            for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)]


def _refused_message(refused: Sequence[str], journal: Journal) -> str:
    more = f"\n  ... and {len(refused) - 20} more" if len(refused) > 20 else ""
    return (f"{len(refused)} request files in {journal.requests} cannot be trusted:\n  " + "\n  ".join(refused[:20])
            + more + "\nRerun the same `kvdiv collect` command: it sets them aside and recollects them.")


def _assemble_doc(journal: Journal, doc_id: str, policies: Sequence[str], streams: Mapping[int, Mapping[str, Any]],
                  layout: RoundLayout) -> Any:
    import protocols

    parts = []
    for policy in policies:
        rounds = {}
        for k, by_policy in streams.items():
            if policy not in by_policy:
                continue  # a later round that did not ask this pair
            try:
                rounds[k] = protocols.assemble_stream(by_policy[policy], doc=doc_id)
            except (protocols.StreamError, protocols.TraceValidationError) as exc:
                raise PackError(f"{journal.for_round(k).path(doc_id, policy).name}: {exc}") from None
        parts.append(stack_rounds(rounds, layout, doc_id, policy) if layout.adaptive else rounds[0])
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


def _collection_attrs(manifest: Mapping[str, Any], layout: RoundLayout) -> dict[str, Any]:
    """Dataset attrs recording how the traces were collected (netCDF-safe scalars).

    For an adaptive collection ``collection`` also holds each round's slots (so that
    ``--append`` refuses a file packed before a round was added) and ``adaptive`` the
    manifest's record of the target, metrics and rounds (``kvdiv.adaptive``).
    """
    params = dict(manifest["params"])
    attrs = {
        "prompt_template": str(params["template"]),  # the name protocols.assemble uses
        "documents_sha256": str(params["docs_sha256"]),
        "collection_seed": int(params["seed"]),
    }
    if params.get("control"):
        attrs["control_policy"] = str(params["control"])
    if layout.adaptive:
        params["round_replicates"] = list(layout.widths)
        attrs["adaptive"] = json.dumps(manifest.get("adaptive") or {}, sort_keys=True)
    attrs["collection"] = json.dumps(params, sort_keys=True)
    return attrs


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
