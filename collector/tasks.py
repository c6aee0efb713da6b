"""RULER-style synthetic tasks: documents that carry their own answers (docs/collector.md, "Tasks").

``kvdiv docs --task NAME`` writes documents in the style of RULER's synthetic tasks
(Hsieh et al., 2024), built here offline and seeded; they are *not* RULER's data:

* ``passkey`` — one needle ("The pass key is 48213. Remember it. 48213 is the pass
  key.") hidden in a haystack; the question asks for the key.
* ``multikey`` — one needle among distractor needles of other keys ("One of the
  special magic numbers for lumpy-ratio is: 4120375."); the question names one key.
* ``multivalue`` — four needles of the same key; the question asks for all its values.
* ``variable-tracking`` — a chain ``VAR ABCDE = 48213``, ``VAR FGHIJ = VAR ABCDE``, ...
  scattered through the haystack; the question asks for every variable holding the value.

The haystack is prose from CPython's ``pydoc_data.topics`` (the built-in source of
:mod:`collector.documents`) or the user's own text, cut into sentences; each document
takes a seeded run of consecutive sentences, so it reads as continuous text, until the
document reaches the target length in the model's tokens. The needle of ``passkey`` and
``multikey`` sits at a depth spread evenly over the documents (0, 1/(n-1), ..., 1), and
the realised depth (the fraction of the document's tokens before the needle) is recorded
as ``needle_depth``; the other tasks place their needles at seeded random positions
(``needle_depth`` is absent). Every document records ``answers``, ``scorer``
(``ruler_all``, RULER's string match), ``task`` and its ``question``, which the ``qa``
prompt template asks after the document.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from collector.documents import Document, TokenCounter, paragraphs, token_counter
from collector.errors import DocumentsError

__all__ = ["TASKS", "TaskSpec", "haystack_sentences", "task_documents"]

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\"'])")
_HEADING = re.compile(r"^[*=\-~^]{3,}$")

# Word lists for multikey / multivalue keys ("adjective-noun", as RULER's keys read).
_ADJECTIVES = ("lumpy", "quiet", "brave", "sturdy", "hollow", "bright", "calm", "eager", "fancy", "gentle",
               "humble", "jolly", "lively", "nimble", "proud", "rapid", "silent", "tidy", "vivid", "witty",
               "zesty", "amber", "coral", "dusty")
_NOUNS = ("ratio", "harbor", "lantern", "meadow", "pebble", "quartz", "river", "saddle", "thimble", "violin",
          "walnut", "anchor", "beacon", "cactus", "dragon", "ember", "falcon", "garnet", "hammer", "island",
          "jacket", "kettle", "ladder", "marble")


@dataclass(frozen=True)
class _Needles:
    """What a task puts into one document."""

    intro: str                 # opens the document
    needles: list[str]         # the inserted sentences; needles[0] is the one whose depth is spread
    question: str
    answers: list[str]
    spread_first: bool         # needles[0] goes at the document's even depth; the rest at random


def _key(rng: np.random.Generator, taken: set[str]) -> str:
    while True:
        key = f"{_ADJECTIVES[rng.integers(len(_ADJECTIVES))]}-{_NOUNS[rng.integers(len(_NOUNS))]}"
        if key not in taken:
            taken.add(key)
            return key


def _number(rng: np.random.Generator, digits: int, taken: set[str]) -> str:
    while True:
        value = str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))
        if value not in taken:
            taken.add(value)
            return value


def _passkey(rng: np.random.Generator) -> _Needles:
    key = _number(rng, 5, set())
    return _Needles(
        "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the pass key.",
        [f"The pass key is {key}. Remember it. {key} is the pass key."],
        "What is the pass key?", [key], spread_first=True)


def _multikey(rng: np.random.Generator, distractors: int = 3) -> _Needles:
    keys: set[str] = set()
    values: set[str] = set()
    pairs = [(_key(rng, keys), _number(rng, 7, values)) for _ in range(1 + distractors)]
    return _Needles(
        "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
        "I will quiz you about the numbers afterwards.",
        [f"One of the special magic numbers for {k} is: {v}." for k, v in pairs],
        f"What is the special magic number for {pairs[0][0]} mentioned in the provided text?",
        [pairs[0][1]], spread_first=True)


def _multivalue(rng: np.random.Generator, count: int = 4) -> _Needles:
    key = _key(rng, set())
    values: set[str] = set()
    vals = [_number(rng, 7, values) for _ in range(count)]
    return _Needles(
        "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
        "I will quiz you about the numbers afterwards.",
        [f"One of the special magic numbers for {key} is: {v}." for v in vals],
        f"What are all the special magic numbers for {key} mentioned in the provided text?",
        vals, spread_first=False)


def _variable_tracking(rng: np.random.Generator, hops: int = 4) -> _Needles:
    names: set[str] = set()
    letters = np.array(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"))
    while len(names) < hops + 1:
        names.add("".join(rng.choice(letters, size=5)))
    chain = sorted(names, key=lambda _: rng.random())
    value = _number(rng, 5, set())
    lines = [f"VAR {chain[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:], strict=False)]
    return _Needles(
        "Memorize and track the chain of variable assignments hidden in the following text.",
        lines, f"Find all variables that are assigned the value {value} in the text above.",
        chain, spread_first=False)


@dataclass(frozen=True)
class TaskSpec:
    """One task: its name, what it asks and how it builds its needles."""

    name: str
    description: str
    build: Callable[[np.random.Generator], _Needles]
    scorer: str = "ruler_all"


#: The tasks ``kvdiv docs --task`` builds, one row each.
TASKS: dict[str, TaskSpec] = {t.name: t for t in (
    TaskSpec("passkey", "one five-digit pass key hidden in the text", _passkey),
    TaskSpec("multikey", "one seven-digit number among three distractors of other keys", _multikey),
    TaskSpec("multivalue", "all four seven-digit numbers of one key", _multivalue),
    TaskSpec("variable-tracking", "every variable of a 5-variable assignment chain holding a value",
             _variable_tracking),
)}


def haystack_sentences(texts: Sequence[str] | None = None) -> list[str]:
    """Prose sentences for a haystack: of ``texts``, or of CPython's pydoc topics.

    Code blocks (indented paragraphs), headings and table rows are left out; a
    paragraph's lines are joined and cut into sentences.

    Parameters
    ----------
    texts : sequence of str, optional
        The user's own texts; None takes ``pydoc_data.topics`` (sorted by topic).

    Returns
    -------
    list of str
        In reading order.

    Raises
    ------
    DocumentsError
        When the texts hold no prose sentence.

    Examples
    --------
    >>> s = haystack_sentences(["First one. Second one!\\n\\n    code()\\n\\nThird."])
    >>> s
    ['First one.', 'Second one!', 'Third.']
    """
    if texts is None:
        from pydoc_data.topics import topics  # stdlib, no network

        texts = [topics[k] for k in sorted(topics)]
    out: list[str] = []
    for text in texts:
        for para in paragraphs(text):
            lines = para.splitlines()
            if para[:1].isspace() or any(_HEADING.match(ln.strip()) for ln in lines) or para.lstrip()[:1] in "+|":
                continue
            joined = " ".join(ln.strip() for ln in lines)
            out.extend(s for s in _SENTENCE_END.split(joined) if s)
    if not out:
        raise DocumentsError("the haystack text holds no prose sentence")
    return out


def _fill(sentences: list[str], start: int, budget: int, count: TokenCounter) -> tuple[list[str], list[int]]:
    """Consecutive sentences from ``start`` (wrapping) whose summed token counts come nearest
    ``budget`` (a sentence is added while it brings the sum closer), and each one's count
    (with its joining space)."""
    taken: list[str] = []
    sizes: list[int] = []
    used, i = 0, start
    while used < budget and len(taken) < len(sentences):
        s = sentences[i % len(sentences)]
        n = count(s) + 1
        if taken and used + n - budget > budget - used:
            break
        taken.append(s)
        sizes.append(n)
        used += n
        i += 1
    return taken, sizes


def _slot(sizes: list[int], depth: float) -> int:
    """The gap between sentences (0..n) whose share of the tokens before it is nearest ``depth``."""
    before = np.concatenate([[0], np.cumsum(sizes)]) / max(sum(sizes), 1)
    return int(np.argmin(np.abs(before - depth)))


def _depths(n: int) -> list[float]:
    return [0.5] if n == 1 else [i / (n - 1) for i in range(n)]


def task_documents(task: str, count: int, *, target_tokens: int, tokenizer: object | None = None,
                   seed: int = 0, haystack: Sequence[str] | None = None, source: str = "pydoc_data.topics",
                   ) -> list[Document]:
    """``count`` documents of a RULER-style task, each about ``target_tokens`` long.

    Parameters
    ----------
    task : str
        A key of :data:`TASKS`.
    count : int
        Documents to build (needle depths spread evenly over them).
    target_tokens : int
        Length of each document's text in the model's tokens (intro, haystack and
        needles; the question is asked after it by the prompt template).
    tokenizer : object with ``encode``, callable, or None
        Counts tokens (:func:`collector.documents.token_counter`).
    seed : int
        Seeds the needles, keys and where each document's haystack starts.
    haystack : sequence of str, optional
        Sentences to fill with (:func:`haystack_sentences`); default the pydoc prose.
    source : str
        Recorded as each document's ``source``.

    Returns
    -------
    list of Document
        Ids ``<task>:<i>``; metadata ``task``, ``answers``, ``scorer``, ``question``,
        ``needle_depth`` (passkey, multikey), ``n_tokens``, ``source``, ``seed``.

    Raises
    ------
    DocumentsError
        An unknown task, or a target too short for the task's own sentences.

    Examples
    --------
    >>> docs = task_documents("passkey", 3, target_tokens=120)
    >>> [d.meta["needle_depth"] for d in docs][0], docs[0].meta["answers"][0] in docs[0].text
    (0.0, True)
    """
    if task not in TASKS:
        raise DocumentsError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    spec = TASKS[task]
    count_tokens = token_counter(tokenizer)
    sentences = list(haystack) if haystack is not None else haystack_sentences()
    rng = np.random.default_rng([seed, sum(map(ord, task))])
    docs = []
    for i, depth in enumerate(_depths(count)):
        needles = spec.build(rng)
        fixed = count_tokens(" ".join([needles.intro, *needles.needles])) + 2
        if fixed >= target_tokens:
            raise DocumentsError(f"--target-tokens {target_tokens} is too short for {task}: its intro and "
                                 f"needles alone take {fixed} tokens")
        filler, sizes = _fill(sentences, int(rng.integers(len(sentences))), target_tokens - fixed, count_tokens)
        first = _slot(sizes, depth) if needles.spread_first else int(rng.integers(len(filler) + 1))
        slots = [first] + sorted(int(k) for k in rng.integers(0, len(filler) + 1, size=len(needles.needles) - 1))
        body = list(filler)
        for pos, needle in sorted(zip(slots, needles.needles, strict=True), key=lambda p: -p[0]):
            body.insert(pos, needle)   # from the back, so earlier slots keep their meaning
        text = needles.intro + "\n\n" + " ".join(body)
        meta = {"source": source, "task": task, "answers": needles.answers, "scorer": spec.scorer,
                "question": needles.question, "n_tokens": count_tokens(text), "seed": seed}
        if needles.spread_first:   # realised: the share of the haystack's tokens before the needle
            hay = text.split("\n\n", 1)[1]
            at = hay.index(needles.needles[0])
            before, after = count_tokens(hay[:at]), count_tokens(hay[at + len(needles.needles[0]):])
            meta["needle_depth"] = round(before / max(before + after, 1), 4)
        docs.append(Document(f"{task}:{i:03d}", text, meta))
    return docs
