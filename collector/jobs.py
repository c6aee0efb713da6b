"""One request of a collection: its job (document, policy, attempts), its ``/v1/traces`` body
(:func:`request_body`) and the check of a stream's header against it (:class:`RequestCheck`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from collector.checks import RunLedger, derive_seed, header_problems
from collector.config import CollectConfig
from collector.documents import Document, prompt_fields
from collector.errors import PermanentError
from collector.journal import Journal
from protocols.kinds import Kind

__all__ = ["Job", "RequestCheck", "request_body"]


@dataclass
class Job:
    """One (document, policy) request of the run: its attempts so far and the tokens of the current one."""

    doc: Document
    policy: str
    attempts: int = 0
    tokens: int = 0   # received in the current attempt
    solo: bool = False   # never grouped again: its group's request was refused as a whole

    @property
    def key(self) -> str:
        return f"{self.doc.id} × {self.policy}"


def request_body(cfg: CollectConfig, doc: Document, policy: str) -> dict[str, Any]:
    """The ``/v1/traces`` JSON for one (document, policy).

    Parameters
    ----------
    cfg : CollectConfig
        The run.
    doc : Document
        The document (rendered with ``cfg.template``).
    policy : str
        The candidate policy id.

    Returns
    -------
    dict
        The request body (docs/service.md); its seed is :func:`derive_seed`.

    Examples
    --------
    >>> cfg = CollectConfig(servers=["http://x"], docs_file="d.jsonl", policies=["snapkv@0.5"], out="o")
    >>> request_body(cfg, Document("d1", "Text."), "snapkv@0.5")["doc_id"]
    'd1'
    """
    s = cfg.sampling
    parameters: dict[str, Any] = {
        "max_new_tokens": cfg.max_new_tokens, "temperature": s.temperature,
        "do_sample": s.temperature > 0,
        "seed": derive_seed(s.seed, doc.id, None if s.common_random_numbers else policy, cfg.round.index),
    }
    if s.top_k is not None:
        parameters["top_k"] = s.top_k
    if s.top_p is not None:
        parameters["top_p"] = s.top_p
    body = {
        **prompt_fields(doc, cfg.template), "parameters": parameters,
        "candidate": policy, "reference": "full", "kind": cfg.kind,
        "replicates": cfg.replicates_for(doc.id, policy), "window": cfg.effective_window, "doc_id": doc.id,
    }
    if cfg.kind == Kind.REFERENCE:
        del body["window"]   # a server refuses a window for reference traces (they have none)
    if cfg.top_logprobs:   # only when asked, so a server without logit traces still serves the rest
        body["top_logprobs"] = cfg.top_logprobs
    return body


class RequestCheck:
    """Checks a stream's header against its request and the run (model, each document's prompt)."""

    def __init__(self, cfg: CollectConfig, journal: Journal, params: dict[str, Any], ledger: RunLedger) -> None:
        self.cfg, self.journal, self.params, self.ledger = cfg, journal, params, ledger

    def __call__(self, job: Job, header: dict[str, Any]) -> None:
        problems = header_problems(header, self.params, job.doc.id, job.policy)
        if problems:
            raise PermanentError("the stream answers another request: " + "; ".join(problems))
        problems = self.ledger.problems(header, job.doc.id)
        if any(p.startswith("prompt") for p in problems):
            # Which prompt is right is unknown: the document's requests are all recollected.
            aside = [self.journal.set_aside(job.doc.id, p) for p in self.cfg.policies]
            self.ledger.forget(job.doc.id)
            names = ", ".join(a.name for a in aside if a is not None) or "none yet"
            problems.append(f"set aside for recollection: {names}")
        if problems:
            raise PermanentError("; ".join(problems))

    def record(self, job: Job, header: dict[str, Any]) -> None:
        if self.ledger.model is None:  # the first complete request fixes the run's model
            manifest = self.journal.read_manifest() or {}
            manifest["model"] = header.get("model")
            self.journal.write_manifest(manifest)
        self.ledger.record(header, job.doc.id)
