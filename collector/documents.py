"""Document sets for trace collection: build, load, select and wrap in a prompt.

A document set is a JSONL file, one object per line with at least ``id`` and
``text`` (plus metadata: ``source``, ``n_tokens``, ``topic``, ``chunk``, ...).
The built-in source needs no network: CPython ships its language reference as
``pydoc_data.topics`` (79 topics, ~465 KB of technical prose). Topics are cut at
paragraph boundaries into chunks of about a target token length, counted with the
model's own tokenizer so that prompt lengths (and hence ``snapkv#N`` budgets) mean
what they say.

Prompt templates put the instruction *after* the document: SnapKV scores prompt
tokens by the attention of the prompt's last window, so the task text must sit
there, as in the SnapKV paper's long-context QA setting.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collector.errors import DocumentsError

__all__ = [
    "DEFAULT_QUESTION", "TEMPLATES", "Document", "DocumentsError", "TokenCounter", "approx_token_count",
    "chunk_text", "file_sha256", "iter_summary", "load_source", "paragraphs", "pydoc_documents", "read_jsonl",
    "read_txt_dir", "prompt_fields", "render_messages", "RAW_SUFFIX",
    "TEMPLATE_NAMES", "select", "select_key", "server_token_counter", "task_field_problem", "token_counter",
    "write_jsonl",
]

TokenCounter = Callable[[str], int]

# Paragraphs are separated by one or more blank lines (pydoc topics, .txt files).
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n+")
_APPROX_TOKEN = re.compile(r"\w+|[^\w\s]")


@dataclass(frozen=True)
class Document:
    """One document: a stable id, its text and free-form metadata."""

    id: str
    text: str
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "text": self.text, **self.meta}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Document:
        meta = {k: v for k, v in obj.items() if k not in ("id", "text")}
        return cls(id=str(obj["id"]), text=str(obj["text"]), meta=meta)


# --------------------------------------------------------------------------- tokens


def approx_token_count(text: str) -> int:
    """A tokenizer-free count (words and punctuation marks), for tests and previews.

    Parameters
    ----------
    text : str
        Any text.

    Returns
    -------
    int
        Words plus punctuation marks.

    Examples
    --------
    >>> approx_token_count("Hello, world!")
    4
    """
    return len(_APPROX_TOKEN.findall(text))


def token_counter(tokenizer: Any | None) -> TokenCounter:
    """A ``text -> n_tokens`` callable from a tokenizer object, a callable, or None.

    A Hugging Face tokenizer is itself callable (returning an encoding), so objects
    with ``encode`` are recognised first; special tokens are left out because the
    chat template adds its own.

    Parameters
    ----------
    tokenizer : object with ``encode``, callable, or None
        None gives :func:`approx_token_count`.

    Returns
    -------
    callable
        ``text -> int``.

    Raises
    ------
    TypeError
        For anything else.

    Examples
    --------
    >>> token_counter(None)("two words")
    2
    >>> token_counter(len)("abc")
    3
    """
    if tokenizer is None:
        return approx_token_count
    if hasattr(tokenizer, "encode"):
        return lambda text: len(tokenizer.encode(text, add_special_tokens=False))
    if callable(tokenizer):
        return tokenizer
    raise TypeError(f"expected a tokenizer (with .encode) or a callable, got {type(tokenizer).__name__}")


def server_token_counter(url: str, api_key: str | None = None, timeout_s: float = 30.0) -> TokenCounter:
    """Count tokens with a running trace server's ``POST /tokenize`` (no local tokenizer, no torch).

    Parameters
    ----------
    url : str
        The server's base URL (``kvdiv serve`` or any TGI-compatible server).
    api_key : str, optional
        Bearer token, when the server requires one.
    timeout_s : float
        Seconds per call.

    Returns
    -------
    callable
        ``text -> number of tokens``. Tokens the server adds (a BOS, with an empty
        offset span) are not counted, like :func:`token_counter` leaves special tokens
        out; repeated texts are asked once.

    Raises
    ------
    DocumentsError
        When the server cannot be reached or answers something other than a token list
        (raised by the counter on first use).

    Examples
    --------
    >>> count = server_token_counter("http://127.0.0.1:8080")  # doctest: +SKIP
    >>> count("Summarise the text above.")                      # doctest: +SKIP
    6
    """
    import functools

    import httpx

    base = url.rstrip("/")
    client = httpx.Client(timeout=timeout_s, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})

    @functools.lru_cache(maxsize=65536)
    def count(text: str) -> int:
        if not text:
            return 0
        try:
            response = client.post(f"{base}/tokenize", json={"inputs": text})
            response.raise_for_status()
            tokens = response.json()
        except httpx.HTTPError as exc:
            raise DocumentsError(f"{base}/tokenize: {type(exc).__name__}: {exc}") from None
        except ValueError:
            raise DocumentsError(f"{base}/tokenize: the answer is not JSON") from None
        if not isinstance(tokens, list) or not all(isinstance(t, dict) for t in tokens):
            raise DocumentsError(f"{base}/tokenize: expected a list of tokens, got {str(tokens)[:80]}")
        return sum(1 for t in tokens if t.get("stop", 1) != t.get("start", 0))

    return count


# --------------------------------------------------------------------------- chunking


def paragraphs(text: str) -> list[str]:
    """Non-empty paragraphs of ``text`` (blank-line separated), trailing spaces trimmed."""
    return [p.strip("\n").rstrip() for p in _PARAGRAPH_BREAK.split(text) if p.strip()]


def _pack(units: list[str], sep: str, count: TokenCounter, target: int) -> list[str]:
    """Greedily join consecutive units with ``sep`` while the result fits ``target``.

    A unit that alone exceeds the target becomes a piece of its own.
    """
    pieces: list[str] = []
    current: list[str] = []
    for unit in units:
        if current and count(sep.join([*current, unit])) > target:
            pieces.append(sep.join(current))
            current = []
        current.append(unit)
    if current:
        pieces.append(sep.join(current))
    return pieces


def _split_long(paragraph: str, count: TokenCounter, target: int) -> list[str]:
    """Cut a paragraph longer than ``target`` at line boundaries (code blocks, lists).

    A single line longer than the target stays whole: cutting inside a line would
    produce text no reader wrote.
    """
    return _pack(paragraph.split("\n"), "\n", count, target)


def chunk_text(text: str, count: TokenCounter, target: int) -> list[str]:
    """Greedy chunks of whole paragraphs, each at most ``target`` tokens where possible.

    Paragraphs are never split unless one alone exceeds the target; then it is cut
    at line boundaries. Chunks are joined with a blank line, as in the source.
    """
    if target < 1:
        raise DocumentsError(f"target tokens must be >= 1, got {target}")
    units: list[str] = []
    for para in paragraphs(text):
        units.extend(_split_long(para, count, target) if count(para) > target else [para])
    return _pack(units, "\n\n", count, target)


# --------------------------------------------------------------------------- sources


def pydoc_documents(
    tokenizer: Any | None = None, *, target_tokens: int = 256, min_tokens: int | None = None
) -> list[Document]:
    """The built-in set: CPython's ``pydoc_data.topics`` chunked to ``target_tokens``.

    Ids are ``pydoc:<topic>:<chunk>``, stable for a given Python version, tokenizer
    and target. Chunks shorter than ``min_tokens`` (default: half the target; the
    tails of topics) are dropped so that prompt lengths stay comparable, and so are
    chunks that are mostly ASCII tables.

    Parameters
    ----------
    tokenizer : object with ``encode``, callable, or None
        Counts tokens (see :func:`token_counter`).
    target_tokens : int
        Chunk length to aim for.
    min_tokens : int, optional
        Shortest chunk kept.

    Returns
    -------
    list of Document
        With metadata ``source``, ``topic``, ``chunk`` and ``n_tokens``.

    Examples
    --------
    >>> docs = pydoc_documents(None, target_tokens=128)
    >>> docs[0].id.startswith("pydoc:") and docs[0].meta["n_tokens"] >= 64
    True
    """
    from pydoc_data.topics import topics  # stdlib; imported lazily (~0.5 MB of text)

    count = token_counter(tokenizer)
    floor = target_tokens // 2 if min_tokens is None else min_tokens
    docs: list[Document] = []
    for topic in sorted(topics):
        for i, chunk in enumerate(chunk_text(topics[topic], count, target_tokens)):
            n = count(chunk)
            if n >= floor and not _mostly_table(chunk):
                docs.append(Document(f"pydoc:{topic}:{i}", chunk,
                                     {"source": "pydoc_data.topics", "topic": topic, "chunk": i, "n_tokens": n}))
    return docs


def _mostly_table(text: str) -> bool:
    """True for chunks that are mostly ASCII-table rows: poor prose to summarise."""
    lines = [ln.lstrip() for ln in text.splitlines() if ln.strip()]
    rows = sum(ln.startswith(("+-", "|", "+=")) for ln in lines)
    return rows > 0.3 * max(len(lines), 1)


def read_jsonl(path: str | os.PathLike[str]) -> list[Document]:
    """Documents from a JSONL file (``id`` and ``text`` required; other keys kept as metadata).

    Parameters
    ----------
    path : path
        The JSONL file; blank lines are skipped.

    Returns
    -------
    list of Document
        In file order.

    Raises
    ------
    DocumentsError
        Naming the file and line: not UTF-8, not JSON, too deeply nested, a line
        without ``id`` or ``text``, duplicate ids.
    OSError
        When the file cannot be opened.

    Examples
    --------
    >>> import tempfile
    >>> path = write_jsonl([Document("a", "text")], Path(tempfile.mkdtemp()) / "d.jsonl")
    >>> read_jsonl(path)[0].id
    'a'
    """
    docs: list[Document] = []
    lineno = 0
    try:
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if line.strip():
                    docs.append(_document(json.loads(line), path, lineno))
    except UnicodeDecodeError as exc:
        raise DocumentsError(f"{path}:{lineno + 1}: not UTF-8 text ({exc.reason})") from None
    except (ValueError, RecursionError) as exc:
        if isinstance(exc, DocumentsError):
            raise
        raise DocumentsError(f"{path}:{lineno}: not JSON ({getattr(exc, 'msg', exc)})") from None
    _check_unique(docs, str(path))
    return docs


def _document(obj: Any, path: str | os.PathLike[str], lineno: int) -> Document:
    if not isinstance(obj, dict) or not isinstance(obj.get("id"), (str, int)) or not isinstance(obj.get("text"), str):
        raise DocumentsError(f"{path}:{lineno}: each line needs an 'id' and a string 'text'")
    problem = task_field_problem(obj)
    if problem:
        raise DocumentsError(f"{path}:{lineno}: {problem}")
    if isinstance(obj.get("answers"), str):   # one answer: a one-item list
        obj = {**obj, "answers": [obj["answers"]]}
    return Document.from_json(obj)


def task_field_problem(obj: dict[str, Any]) -> str | None:
    """The first problem with a document's task fields (docs/collector.md, "Tasks and answers"), or None.

    Parameters
    ----------
    obj : dict
        One document's JSON object.

    Returns
    -------
    str or None
        ``field 'NAME': what is wrong``.

    Examples
    --------
    >>> task_field_problem({"answers": ["1"], "scorer": "ruler_all"}) is None
    True
    >>> task_field_problem({"scorer": "exact"})
    "field 'scorer': a scorer is asked but the document has no 'answers'"
    """
    from protocols.scoring import UnknownScorerError, get_scorer

    answers = obj.get("answers")
    if answers is not None and not (isinstance(answers, str) or (
            isinstance(answers, list) and all(isinstance(a, str) for a in answers))):
        return f"field 'answers': expected a list of strings, got {json.dumps(answers)[:60]}"
    if "scorer" in obj:
        if not isinstance(obj["scorer"], str):
            return f"field 'scorer': expected a scorer's name, got {json.dumps(obj['scorer'])[:60]}"
        if answers is None:
            return "field 'scorer': a scorer is asked but the document has no 'answers'"
        try:
            get_scorer(obj["scorer"])
        except UnknownScorerError as exc:
            return f"field 'scorer': {exc}"
    depth = obj.get("needle_depth")
    if depth is not None and not (isinstance(depth, (int, float)) and not isinstance(depth, bool) and 0 <= depth <= 1):
        return f"field 'needle_depth': expected a number in [0, 1], got {json.dumps(depth)[:60]}"
    if "task" in obj and not isinstance(obj["task"], str):
        return f"field 'task': expected a string, got {json.dumps(obj['task'])[:60]}"
    return None


def read_txt_dir(path: str | os.PathLike[str]) -> list[Document]:
    """One document per ``*.txt`` file (sorted by name; id = file stem).

    Parameters
    ----------
    path : path
        A folder.

    Returns
    -------
    list of Document
        With metadata ``source`` (the file).

    Raises
    ------
    DocumentsError
        When the folder holds no ``.txt`` file.
    """
    folder = Path(path)
    docs = [Document(p.stem, p.read_text(encoding="utf-8").strip(), {"source": str(p)})
            for p in sorted(folder.glob("*.txt"))]
    if not docs:
        raise DocumentsError(f"{folder}: no .txt files")
    return docs


def load_source(source: str, tokenizer: Any | None = None, *, target_tokens: int = 256,
                chunk: bool = False) -> list[Document]:
    """Documents from ``pydoc`` (built-in), a JSONL file or a folder of ``.txt`` files.

    User documents are taken whole unless ``chunk`` is set, in which case they are
    cut like the built-in set (ids ``<id>:<chunk>``).

    Parameters
    ----------
    source : str
        ``"pydoc"``, a JSONL path or a folder path.
    tokenizer : object with ``encode``, callable, or None
        Counts tokens (``n_tokens`` metadata, chunk lengths).
    target_tokens : int
        Chunk length to aim for.
    chunk : bool
        Cut user documents at paragraph boundaries.

    Returns
    -------
    list of Document
        Each with ``n_tokens``.

    Raises
    ------
    DocumentsError, OSError
        From :func:`read_jsonl` or :func:`read_txt_dir`.

    Examples
    --------
    >>> len(load_source("pydoc", None, target_tokens=256)) > 100
    True
    """
    if source == "pydoc":
        return pydoc_documents(tokenizer, target_tokens=target_tokens)
    path = Path(source)
    docs = read_txt_dir(path) if path.is_dir() else read_jsonl(path)
    count = token_counter(tokenizer)
    if not chunk:
        return [Document(d.id, d.text, {**d.meta, "n_tokens": count(d.text)}) for d in docs]
    return [Document(f"{d.id}:{i}", piece, {**d.meta, "parent": d.id, "chunk": i, "n_tokens": count(piece)})
            for d in docs for i, piece in enumerate(chunk_text(d.text, count, target_tokens))]


def _check_unique(docs: Sequence[Document], where: str) -> None:
    seen: set[str] = set()
    dupes: set[str] = set()
    for doc in docs:
        (dupes if doc.id in seen else seen).add(doc.id)
    if dupes:
        raise DocumentsError(f"{where}: duplicate document ids {sorted(dupes)[:5]}")


def select_key(doc: Document) -> str:
    """The order :func:`select` takes documents in (a hash of the id).

    Parameters
    ----------
    doc : Document
        Any document.

    Returns
    -------
    str
        sha256 of the id, hex.

    Examples
    --------
    >>> len(select_key(Document("a", "x")))
    64
    """
    return hashlib.sha256(doc.id.encode("utf-8")).hexdigest()


def select(docs: Sequence[Document], count: int | None) -> list[Document]:
    """A deterministic, topic-spread subset of ``count`` documents (all if None).

    Ordering by a hash of the id rather than taking the first ``count`` avoids a
    demo made only of topics starting with "a".

    Parameters
    ----------
    docs : sequence of Document
        The candidates.
    count : int or None
        How many to keep.

    Returns
    -------
    list of Document
        The chosen ones, in their original order.

    Examples
    --------
    >>> docs = [Document(str(i), "x") for i in range(10)]
    >>> len(select(docs, 3)), select(docs, 3) == select(docs, 3)
    (3, True)
    """
    if count is None or count >= len(docs):
        return list(docs)
    ranked = sorted(docs, key=select_key)
    chosen = {d.id for d in ranked[:count]}
    return [d for d in docs if d.id in chosen]


def write_jsonl(docs: Iterable[Document], path: str | os.PathLike[str]) -> Path:
    """Write documents as JSONL atomically (temp file + rename).

    Parameters
    ----------
    docs : iterable of Document
        What to write.
    path : path
        The JSONL file (its folder is created).

    Returns
    -------
    Path
        ``path``.

    Examples
    --------
    >>> import tempfile
    >>> write_jsonl([Document("a", "x")], Path(tempfile.mkdtemp()) / "d.jsonl").name
    'd.jsonl'
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for doc in docs:
            fh.write(json.dumps(doc.to_json(), ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    return out


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 of a file's bytes (the manifest's record of which documents were used).

    Parameters
    ----------
    path : path
        Any file.

    Returns
    -------
    str
        64 hex digits.

    Examples
    --------
    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "f"
    >>> _ = path.write_bytes(b"")
    >>> file_sha256(path)[:12]
    'e3b0c44298fc'
    """
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------- prompts

DEFAULT_QUESTION = "What is the main rule or behaviour the text above describes, and why does it matter?"

#: Template name -> user-turn format. ``{text}`` is the document, ``{question}`` its
#: own ``question`` field or DEFAULT_QUESTION. The instruction comes last (see module doc).
TEMPLATES: dict[str, str] = {
    "summarise": "{text}\n\nSummarise the text above in a few sentences.",
    "qa": "{text}\n\nAnswer the question about the text above.\nQuestion: {question}",
}


#: A template name with this suffix (``summarise-raw``) is for a base model without a chat
#: template: the document goes in as raw ``context`` (after the model's BOS) and the
#: template's instruction after it as ``question`` (kvpress's split: the press compresses
#: the document only).
RAW_SUFFIX = "-raw"
#: Every template name ``--template`` takes: the chat ones and their raw forms.
TEMPLATE_NAMES: tuple[str, ...] = tuple(sorted(TEMPLATES)) + tuple(sorted(t + RAW_SUFFIX for t in TEMPLATES))


def prompt_fields(doc: Document, template: str) -> dict[str, Any]:
    """The request's prompt fields for one document: ``messages`` under a chat template
    name, ``context`` and ``question`` under its raw form (:data:`RAW_SUFFIX`).

    Examples
    --------
    >>> prompt_fields(Document("a", "Body."), "summarise-raw")
    {'context': 'Body.', 'question': '\\n\\nSummarise the text above in a few sentences.'}
    >>> list(prompt_fields(Document("a", "Body."), "summarise"))
    ['messages']
    """
    if not template.endswith(RAW_SUFFIX):
        return {"messages": render_messages(doc, template)}
    base = template[:-len(RAW_SUFFIX)]
    if base not in TEMPLATES:
        raise DocumentsError(f"unknown template {template!r}; choose from {list(TEMPLATE_NAMES)}")
    question = str(doc.meta.get("question") or DEFAULT_QUESTION)
    head, _, tail = TEMPLATES[base].partition("{text}")
    return {"context": head.format(question=question) + doc.text, "question": tail.format(question=question)}


def render_messages(doc: Document, template: str) -> list[dict[str, str]]:
    """Chat messages for one document under a named template (the server applies the chat template).

    Parameters
    ----------
    doc : Document
        The document.
    template : str
        A key of :data:`TEMPLATES`.

    Returns
    -------
    list of dict
        One user turn (``role``, ``content``).

    Raises
    ------
    DocumentsError
        For an unknown template.

    Examples
    --------
    >>> render_messages(Document("a", "Body."), "summarise")[0]["content"].splitlines()[0]
    'Body.'
    """
    if template not in TEMPLATES:
        raise DocumentsError(f"unknown template {template!r}; choose from {sorted(TEMPLATES)}")
    question = str(doc.meta.get("question") or DEFAULT_QUESTION)
    return [{"role": "user", "content": TEMPLATES[template].format(text=doc.text, question=question)}]


def iter_summary(docs: Sequence[Document]) -> Iterator[str]:
    """Human-readable lines describing a document set (count and token-length spread)."""
    sizes = sorted(int(d.meta.get("n_tokens", 0)) for d in docs)
    yield f"{len(docs)} documents"
    if sizes and sizes[-1] > 0:
        mid = sizes[len(sizes) // 2]
        yield f"tokens per document: min {sizes[0]}, median {mid}, max {sizes[-1]}"
