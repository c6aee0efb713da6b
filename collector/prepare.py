"""Before a collection: the run directory created or checked (documents copied, the manifest
written or compared, a later round's allocation recorded), in :func:`prepare_run`."""

from __future__ import annotations

from pathlib import Path

from collector.config import CollectConfig
from collector.documents import Document, file_sha256, read_jsonl
from collector.errors import ConfigError, DocumentsError
from collector.journal import DOCUMENTS, Journal
from collector.servers import read_servers_file

__all__ = ["prepare_run"]


def prepare_run(cfg: CollectConfig) -> tuple[Journal, list[Document]]:
    """Create or check the run directory: copy the documents and write/compare the manifest.

    Parameters
    ----------
    cfg : CollectConfig
        The run.

    Returns
    -------
    (Journal, list of Document)
        The journal of the config's round and the run's documents.

    Raises
    ------
    DocumentsError
        An unreadable or empty documents file.
    ManifestMismatch
        A resume with other trace-deciding parameters (each difference named), or a
        later round whose recorded allocation differs from the config's.
    JournalError
        An unreadable manifest, or an ``--out`` folder that is not a run.
    ConfigError
        An unreadable ``servers_file``.
    """
    servers_file = cfg.pool.servers_file
    if servers_file is not None:  # a typo in the path is refused now, not after a wait for servers
        try:
            read_servers_file(servers_file)
        except OSError as exc:
            raise ConfigError(f"{servers_file}: cannot read the servers file ({exc.strerror or exc})") from None
    journal = Journal(cfg.out)
    docs = read_jsonl(cfg.docs_file)
    if not docs:
        raise DocumentsError(f"{cfg.docs_file}: no documents")
    digest = file_sha256(cfg.docs_file)
    journal.start(cfg.params(digest), {
        "servers": cfg.servers, "servers_file": str(servers_file) if servers_file else None,
        "concurrency": cfg.pool.concurrency, "docs_file": str(cfg.docs_file),
        "documents": DOCUMENTS, "n_docs": len(docs),
    })
    copy = journal.dir / DOCUMENTS
    if not copy.exists() or file_sha256(copy) != digest:
        copy.write_bytes(Path(cfg.docs_file).read_bytes())  # pack reads the run dir alone
    if cfg.round.index:  # a later round: its allocation is recorded (or checked) before any request
        unknown = sorted(set(cfg.round.allocation or {}) - {doc.id for doc in docs})
        if unknown:
            raise ConfigError(f"round {cfg.round.index}'s allocation names documents not in "
                              f"{cfg.docs_file}: {', '.join(unknown[:5])}")
        journal = journal.for_round(cfg.round.index)
        journal.write_allocation(cfg.round.allocation or {})
    return journal, docs
