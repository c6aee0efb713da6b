"""What makes a stream trustworthy for its request (docs/collector.md, "What is checked").

A stream's sha256 proves that its bytes arrived as sent, not that they answer the
request: a proxy that rewrites the request, or a server that ignores a field, sends
a perfectly digested stream of another experiment. So every header field is checked
against what was asked (:func:`header_problems`), and what the client cannot know
in advance is checked for agreement across the run (:class:`RunLedger`): one model
for the whole run, one prompt (token count and ``prompt_sha256``) per document.

The same checks run when a request arrives, when ``collect`` resumes (a journal file
that fails them is set aside and recollected) and when ``pack`` reads the journal.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from collector.journal import Journal
from protocols.stream import Stream, StreamError, read_stream

__all__ = ["RunLedger", "asked_replicates", "audit_document", "derive_seed", "header_problems", "read_request"]


def derive_seed(seed: int, doc_id: str, policy: str | None, round_index: int = 0) -> int:
    """A per-request seed from (seed, doc, policy, round): order-independent, so resume == rerun.

    Parameters
    ----------
    seed : int
        The run's seed.
    doc_id : str
        The request's document id.
    policy : str or None
        The candidate policy id; None derives the seed from (seed, doc) alone, so
        every policy of a document shares its random numbers (common random numbers,
        docs/design.md).
    round_index : int
        The collection round (0: the first or only one; later rounds of an adaptive
        collection, docs/design.md). Each round draws fresh random numbers; round 0's
        key is the one runs used before rounds existed, so they resume unchanged.

    Returns
    -------
    int
        31 bits, safe for every RNG API.

    Examples
    --------
    >>> derive_seed(0, "doc1", "snapkv@0.5") == derive_seed(0, "doc1", "snapkv@0.5")
    True
    >>> derive_seed(0, "doc1", "snapkv@0.5", round_index=1) == derive_seed(0, "doc1", "snapkv@0.5")
    False
    """
    key = f"kvdiv:{seed}\0{doc_id}" + ("" if policy is None else f"\0{policy}")
    if round_index:
        key += f"\0round={round_index}"
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def asked_replicates(params: Mapping[str, Any], doc_id: str, policy: str) -> int:
    """Replicates asked of (doc_id, policy): the round's allocation when there is one, else the run's R.

    Parameters
    ----------
    params : mapping
        The run's (or the round's) parameters, see :func:`header_problems`.
    doc_id, policy : str
        The slot.

    Returns
    -------
    int
        0 when the round allocates the slot nothing (no request).

    Examples
    --------
    >>> asked_replicates({"replicates": 8}, "d", "p"), asked_replicates({"allocation": {"d": {"p": 3}}}, "d", "p")
    (8, 3)
    """
    if "allocation" in params:
        return int(params["allocation"].get(doc_id, {}).get(policy, 0))
    return int(params["replicates"])


def _off(value: Any, neutral: Any) -> Any:
    """top_k 0 and top_p 1.0 mean "not applied", like an absent value."""
    return None if value is None or value == neutral else value


def _sampling_problems(sampling: Any, params: Mapping[str, Any]) -> list[str]:
    if not isinstance(sampling, Mapping):
        return [f"sampling is {sampling!r}, not an object"]
    greedy = params["temperature"] == 0
    asked = {"temperature": 0.0 if greedy else float(params["temperature"]),
             "top_k": _off(params.get("top_k"), 0), "top_p": _off(params.get("top_p"), 1.0)}
    got = {"temperature": sampling.get("temperature"), "top_k": _off(sampling.get("top_k"), 0),
           "top_p": _off(sampling.get("top_p"), 1.0)}
    problems = [f"sampling.{k} is {got[k]!r}, asked {v!r}" for k, v in asked.items() if got[k] != v]
    if "do_sample" in sampling and sampling["do_sample"] != (not greedy):
        problems.append(f"sampling.do_sample is {sampling['do_sample']!r}, asked {not greedy!r}")
    return problems


def header_problems(header: Mapping[str, Any], params: Mapping[str, Any], doc_id: str, policy: str, *,
                    require_prompt_sha256: bool = True) -> list[str]:
    """Every way a stream's header does not answer the request for (doc_id, policy).

    Parameters
    ----------
    header : mapping
        The stream's header record (already well formed: see ``protocols.stream``).
    params : mapping
        The run's parameters (the manifest's ``params``: kind, replicates,
        max_new_tokens, window, temperature, top_k, top_p, seed, reference); for a
        later round of an adaptive collection also ``round`` and ``allocation``
        (doc -> policy -> replicates), which then decide the seed and R asked.
    doc_id, policy : str
        The request's document and candidate policy.
    require_prompt_sha256 : bool
        Refuse a header without ``prompt_sha256``. True for streams arriving now;
        journal files collected before the field existed are read with False.

    Returns
    -------
    list of str
        One ``"field is X, asked Y"`` line per mismatch; empty when the header fits.

    Examples
    --------
    >>> params = dict(kind="coupled", replicates=2, max_new_tokens=4, window=4, temperature=1.0,
    ...               top_k=None, top_p=None, seed=0, reference="full")
    >>> header = dict(kind="coupled", replicates=2, horizon=4, window=4, doc="d",
    ...               candidate={"policy": "recent@0.5"}, reference={"policy": "full"},
    ...               sampling={"temperature": 1.0}, seed=derive_seed(0, "d", "snapkv@0.5"),
    ...               prompt_tokens=9, prompt_sha256="0" * 64)
    >>> header_problems(header, params, "d", "snapkv@0.5")
    ["candidate.policy is 'recent@0.5', asked 'snapkv@0.5'"]
    """
    asked = {
        "doc": doc_id, "kind": params["kind"], "horizon": params["max_new_tokens"],
        "replicates": asked_replicates(params, doc_id, policy), "window": params["window"],
        "seed": derive_seed(params["seed"], doc_id, None if params.get("common_random_numbers") else policy,
                            params.get("round", 0)),
    }
    problems = [f"{k} is {header.get(k)!r}, asked {v!r}" for k, v in asked.items() if header.get(k) != v]
    top = params.get("top_logprobs", 0)
    if int(header.get("top_logprobs") or 0) != top:   # absent: a server that sends no logit traces
        problems.append(f"top_logprobs is {header.get('top_logprobs')!r}, asked {top!r}")
    candidate = (header.get("candidate") or {}).get("policy")
    if candidate != policy:
        problems.append(f"candidate.policy is {candidate!r}, asked {policy!r}")
    reference = (header.get("reference") or {}).get("policy") if isinstance(header.get("reference"), Mapping) \
        else None
    if reference != params.get("reference", "full"):
        problems.append(f"reference.policy is {reference!r}, asked {params.get('reference', 'full')!r}")
    problems += _sampling_problems(header.get("sampling"), params)
    n = header.get("prompt_tokens")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        problems.append(f"prompt_tokens is {n!r}, not a positive count")
    if require_prompt_sha256 and not isinstance(header.get("prompt_sha256"), str):
        problems.append("prompt_sha256 is missing (the server predates docs/contract.md §3's prompt digest)")
    problems += _eos_problems(header)
    return problems


def _eos_problems(header: Mapping[str, Any]) -> list[str]:
    """``eos_token_ids`` (every EOS id; optional: older servers send ``eos_token_id`` alone)
    must be a list of ids holding ``eos_token_id``."""
    ids, eos = header.get("eos_token_ids"), header.get("eos_token_id")
    if ids is None:
        return []
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        return [f"eos_token_ids is {ids!r}, not a list of token ids"]
    if isinstance(eos, int) and eos >= 0 and eos not in ids:
        return [f"eos_token_id is {eos!r}, not one of eos_token_ids {ids!r}"]
    return []


@dataclass
class RunLedger:
    """What a run's requests must agree on: the model, and per document the prompt.

    Attributes
    ----------
    model : str or None
        The run's model (fixed by the first request that completes).
    prompts : dict
        doc id -> ``(prompt_tokens, prompt_sha256)`` of its complete requests.
    """

    model: str | None = None
    prompts: dict[str, tuple[Any, Any]] = field(default_factory=dict)

    def problems(self, header: Mapping[str, Any], doc_id: str) -> list[str]:
        """Disagreements of ``header`` with the run's model and ``doc_id``'s prompt (nothing recorded)."""
        problems = []
        model = header.get("model")
        if self.model is not None and model != self.model:
            problems.append(f"model is {model!r}, this run uses {self.model!r}")
        prompt = (header.get("prompt_tokens"), header.get("prompt_sha256"))
        seen = self.prompts.get(doc_id)
        if seen is not None and not _same_prompt(prompt, seen):
            problems.append(f"prompt (tokens, sha256) is {_short(prompt)}, the document's other requests "
                            f"saw {_short(seen)}")
        return problems

    def record(self, header: Mapping[str, Any], doc_id: str) -> None:
        """Remember a complete request's model and prompt."""
        if self.model is None:
            self.model = header.get("model")
        n, sha = header.get("prompt_tokens"), header.get("prompt_sha256")
        seen = self.prompts.get(doc_id)
        if seen is None or seen[1] is None:  # a digest fills in what an older file lacked
            self.prompts[doc_id] = (n, sha if sha is not None else (seen or (None, None))[1])

    def forget(self, doc_id: str) -> None:
        """Drop a document's prompt (its requests were set aside)."""
        self.prompts.pop(doc_id, None)

    def learn_prompts(self, journal: Journal, doc_ids: Sequence[str], policies: Sequence[str]) -> None:
        """Record each document's prompt from the header of one of its complete requests in ``journal``.

        A later round of an adaptive collection starts from round 0's prompts, so that
        a round-k stream of another prompt is refused (and a resumed round sets such a
        file aside) as within one round. Only the first line (the header) is read; the
        files were checked when they completed.
        """
        for doc_id in doc_ids:
            for policy in policies:
                try:
                    with open(journal.path(doc_id, policy), "rb") as fh:
                        header = json.loads(fh.readline())
                except (OSError, ValueError):
                    continue
                if isinstance(header, dict) and header.get("type") == "header":
                    self.record(header, doc_id)
                    break


def _same_prompt(a: tuple[Any, Any], b: tuple[Any, Any]) -> bool:
    """Token counts must agree; digests too, where both requests carry one."""
    return a[0] == b[0] and (a[1] is None or b[1] is None or a[1] == b[1])


def _short(prompt: tuple[Any, Any]) -> str:
    n, sha = prompt
    return f"({n}, {str(sha)[:12]}…)"


def read_request(journal: Journal, doc_id: str, policy: str, params: Mapping[str, Any],
                 ledger: RunLedger) -> tuple[Stream | None, str | None]:
    """Read and check one complete request file of the journal.

    Parameters
    ----------
    journal : Journal
        The run.
    doc_id, policy : str
        The slot.
    params : mapping
        The run's parameters (the manifest's ``params``).
    ledger : RunLedger
        The run's model and per-document prompts so far (updated when the file checks out).

    Returns
    -------
    (Stream, None)
        The file reads (digest, order, shapes) and its header answers (doc_id, policy)
        and agrees with the ledger (which then records it).
    (None, str)
        The file exists but cannot be trusted: the problem, naming the file.
    (None, None)
        There is no complete file for the slot.
    """
    path = journal.path(doc_id, policy)
    if not path.exists():
        return None, None
    try:
        with open(path, "rb") as fh:
            stream = read_stream(fh)
    except StreamError as exc:
        return None, f"{path.name}: {exc}"
    except OSError as exc:
        return None, f"{path.name}: cannot read ({exc.strerror or exc})"
    # Files from before prompt_sha256 existed stay readable; new streams must carry it.
    problems = (header_problems(stream.header, params, doc_id, policy, require_prompt_sha256=False)
                + ledger.problems(stream.header, doc_id))
    if problems:
        return None, f"{path.name}: not the request for {doc_id} × {policy}: " + "; ".join(problems)
    ledger.record(stream.header, doc_id)
    return stream, None


def audit_document(journal: Journal, doc_id: str, policies: Sequence[str], params: Mapping[str, Any],
                   ledger: RunLedger) -> tuple[dict[str, Stream], dict[str, str]]:
    """Check every complete request of one document (see :func:`read_request`).

    When the document's files disagree on the prompt, none of them can be trusted
    (which one is right is unknown): all are rejected.

    Parameters
    ----------
    journal : Journal
        The run.
    doc_id : str
        The document.
    policies : sequence of str
        The run's policies.
    params : mapping
        The run's parameters.
    ledger : RunLedger
        The run's model and per-document prompts so far.

    Returns
    -------
    (dict, dict)
        policy -> checked :class:`protocols.Stream`, and policy -> problem (naming the
        file) for each file that cannot be trusted; absent files are in neither.
    """
    streams: dict[str, Stream] = {}
    rejected: dict[str, str] = {}
    for policy in policies:
        stream, problem = read_request(journal, doc_id, policy, params, ledger)
        if stream is not None:
            streams[policy] = stream
        elif problem is not None:
            rejected[policy] = problem
    if any("prompt (tokens, sha256)" in p for p in rejected.values()):
        ledger.forget(doc_id)
        for policy in list(streams):
            rejected[policy] = (f"{journal.path(doc_id, policy).name}: the document's requests disagree on "
                                "the prompt; all of them are recollected")
            del streams[policy]
    return streams, rejected
