"""Complete answers: P's and Q's texts decoded from the traces' tokens, scored at pack time.

When the documents carry ``answers`` (docs/collector.md, "Tasks and answers"), a
``coupled`` collection ends by decoding each complete request's answers with the
model's own tokenizer: the server's ``POST /detokenize`` takes P's and each Q's tokens
up to the first EOS (replicate by replicate) and returns the texts and where each
token ends in them. The traces stay the contract: the texts are derived from the
request files' tokens, and each is kept beside its request in the journal,

    answers/<doc>--<policy>--<h>.json     {"request_sha256", "x_text", "y_text", "x_ends"}

tied to the request file by its sha256, so a request set aside and collected again is
decoded again. ``kvdiv pack`` reads them and adds the answer variables
(docs/contract.md "Answers"): ``x_text``, ``y_text``, ``x_score`` and ``y_score`` with
the document's scorer, ``x_answer_start`` (the step where P's answer starts), and per
document ``answers``, ``scorer``, ``task``, ``needle_depth``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from collector.documents import Document, file_sha256
from collector.errors import PackError
from collector.journal import Journal, request_name

__all__ = ["ANSWERS_DIR", "DEFAULT_SCORER", "answer_ids", "answer_variables_for", "decode_answers", "has_answers",
           "read_texts", "text_path", "undecoded"]

#: The journal folder holding the decoded answers.
ANSWERS_DIR = "answers"
#: The scorer of documents with answers and no ``scorer`` field.
DEFAULT_SCORER = "ruler_all"
_ROWS_PER_CALL = 512   # rows per /detokenize request


def has_answers(docs: Sequence[Document]) -> bool:
    """Whether any document carries ``answers`` (then a coupled collection decodes them)."""
    return any("answers" in d.meta for d in docs)


def text_path(journal: Journal, doc_id: str, policy: str) -> Path:
    """Where the decoded answers of one request are kept."""
    return journal.dir / ANSWERS_DIR / f"{request_name(doc_id, policy)}.json"


def answer_ids(tokens: np.ndarray, eos: Sequence[int]) -> list[list[int]]:
    """Each row's tokens up to (not including) its first EOS id.

    Parameters
    ----------
    tokens : numpy.ndarray
        (replicate, step) token ids of one side.
    eos : sequence of int
        The EOS ids (absorbing: everything after the first is EOS).

    Returns
    -------
    list of list of int

    Raises
    ------
    None

    Examples
    --------
    >>> answer_ids(np.array([[5, 6, 2, 2], [7, 8, 9, 1]]), [2])
    [[5, 6], [7, 8, 9, 1]]
    """
    out = []
    for row in np.asarray(tokens).tolist():
        cut = next((i for i, t in enumerate(row) if t in set(eos)), len(row))
        out.append(row[:cut])
    return out


def _request_tokens(journal: Journal, doc_id: str, policy: str) -> tuple[list[list[int]], list[list[int]]]:
    """P's and Q's answer ids of one complete request, per replicate."""
    import protocols

    ds = protocols.assemble(journal.path(doc_id, policy).read_bytes())
    eos = protocols.eos_ids(ds.attrs)
    return (answer_ids(ds.x_token.values[0, 0], eos), answer_ids(ds.y_token.values[0, 0], eos))


def _write_json(path: Path, record: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)


def read_texts(journal: Journal, doc_id: str, policy: str) -> dict[str, Any] | None:
    """The decoded answers of one complete request, or None when missing or stale (its request
    file changed since, e.g. recollected)."""
    path = text_path(journal, doc_id, policy)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("request_sha256") != file_sha256(journal.path(doc_id, policy)):
        return None
    return record


def undecoded(journal: Journal, docs: Sequence[Document], policies: Sequence[str]) -> list[tuple[str, str]]:
    """(document, policy) pairs with a complete request, answers to decode and no current texts."""
    return [(d.id, p) for d in docs if "answers" in d.meta for p in policies
            if journal.path(d.id, p).exists() and read_texts(journal, d.id, p) is None]


async def decode_answers(client: Any, journal: Journal, docs: Sequence[Document], policies: Sequence[str],
                         servers: Sequence[str], say: Callable[[str], None] = print) -> int:
    """Decode the answers of every complete request that lacks them, through a server's ``/detokenize``.

    Parameters
    ----------
    client : httpx.AsyncClient
        The collection's client (its headers carry the API key).
    journal : Journal
        The run (round 0).
    docs, policies : sequence
        The run's documents and policies.
    servers : sequence of str
        Server base URLs, tried in turn until one answers.
    say : callable
        Where a failure is reported (one line).

    Returns
    -------
    int
        Requests decoded by this call (those already decoded are skipped).

    Raises
    ------
    None
        A failure is reported through ``say`` and leaves the requests undecoded:
        rerunning ``kvdiv collect`` decodes them, and ``kvdiv pack`` refuses to pack
        answers it does not have.
    """
    import httpx

    todo = undecoded(journal, docs, policies)
    done = 0
    pending: list[tuple[str, str, int, list[list[int]]]] = []   # doc, policy, R, rows (P's then Q's)

    async def flush() -> int:
        rows = [r for *_, block in pending for r in block]
        answer = await _detokenize(client, servers, rows, httpx)
        k = 0
        for doc_id, policy, n_rep, block in pending:
            texts, ends = answer["texts"][k:k + len(block)], answer["ends"][k:k + len(block)]
            k += len(block)
            _write_json(text_path(journal, doc_id, policy), {
                "request_sha256": file_sha256(journal.path(doc_id, policy)),
                "x_text": texts[:n_rep], "y_text": texts[n_rep:], "x_ends": ends[:n_rep]})
        n = len(pending)
        pending.clear()
        return n

    try:
        for doc_id, policy in todo:
            xs, ys = _request_tokens(journal, doc_id, policy)
            pending.append((doc_id, policy, len(xs), xs + ys))
            if sum(len(b) for *_, b in pending) >= _ROWS_PER_CALL:
                done += await flush()
        if pending:
            done += await flush()
    except (OSError, ValueError, KeyError, httpx.HTTPError) as exc:
        say(f"answers: {len(todo) - done} of {len(todo)} requests not decoded ({type(exc).__name__}: {exc}); "
            "rerun the same `kvdiv collect` command to decode them")
    return done


async def _detokenize(client: Any, servers: Sequence[str], rows: list[list[int]], httpx: Any) -> dict[str, Any]:
    """One ``/detokenize`` call, on the first server that answers it."""
    last: Exception = ValueError("no server to decode the answers with")
    for url in servers:
        try:
            response = await client.post(f"{url.rstrip('/')}/detokenize", json={"ids": rows})
            response.raise_for_status()
            answer = response.json()
            if len(answer.get("texts", [])) != len(rows) or len(answer.get("ends", [])) != len(rows):
                raise ValueError(f"{url}/detokenize answered {len(answer.get('texts', []))} texts for {len(rows)} rows")
            return answer
        except (httpx.HTTPError, ValueError) as exc:
            last = exc
    raise last


# --------------------------------------------------------------------------- packing


def _answer_start(text: str, ends: Sequence[int], answers: Sequence[str]) -> int:
    """The step index of the token where the first answer occurrence in ``text`` begins (-1: none)."""
    from protocols.scoring import answer_span

    at = answer_span(text, answers)
    if at < 0:
        return -1
    return next((k for k, end in enumerate(ends) if end > at), -1)


def answer_variables_for(journal: Journal, doc: Document, policies: Sequence[str], n_rep: int) -> dict[str, Any]:
    """The answer variables of one packed document (shaped (1, policy, replicate) and (1,)).

    Parameters
    ----------
    journal : Journal
        The run (round 0).
    doc : Document
        A document carrying ``answers``.
    policies : sequence of str
        The run's policies, in the dataset's order.
    n_rep : int
        Replicates per request.

    Returns
    -------
    dict of str to xarray.Variable
        ``protocols.answer_variables`` for the document.

    Raises
    ------
    PackError
        A request without decoded answers, or decoded answers of the wrong size.
    """
    from protocols import answer_variables
    from protocols.scoring import score

    answers = [str(a) for a in doc.meta["answers"]]
    scorer = str(doc.meta.get("scorer", DEFAULT_SCORER))
    shape = (1, len(policies), n_rep)
    x_text, y_text = np.empty(shape, dtype=object), np.empty(shape, dtype=object)
    x_score, y_score = np.full(shape, np.nan), np.full(shape, np.nan)
    start = np.full(shape, -1, dtype=np.int32)
    for j, policy in enumerate(policies):
        record = read_texts(journal, doc.id, policy)
        if record is None:
            raise PackError(f"{doc.id} × {policy}: its answers are not decoded ({text_path(journal, doc.id, policy)} "
                            "is missing or older than the request); rerun the same `kvdiv collect` command with a "
                            "server up: it decodes the answers of complete requests")
        if not all(len(record.get(k, ())) == n_rep for k in ("x_text", "y_text", "x_ends")):
            raise PackError(f"{text_path(journal, doc.id, policy)}: not {n_rep} replicates; delete it and rerun "
                            "`kvdiv collect`")
        for r in range(n_rep):
            x_text[0, j, r], y_text[0, j, r] = str(record["x_text"][r]), str(record["y_text"][r])
            x_score[0, j, r] = score(scorer, x_text[0, j, r], answers)
            y_score[0, j, r] = score(scorer, y_text[0, j, r], answers)
            start[0, j, r] = _answer_start(x_text[0, j, r], record["x_ends"][r], answers)
    depth = doc.meta.get("needle_depth")
    return answer_variables(
        *shape, x_score=x_score, y_score=y_score, x_text=x_text, y_text=y_text, x_answer_start=start,
        answers=[answers], scorer=[scorer], task=[str(doc.meta.get("task", ""))],
        needle_depth=[math.nan if depth is None else float(depth)])
