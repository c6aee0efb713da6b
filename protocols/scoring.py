"""Task scorers: (output text, acceptable answers) -> a score in [0, 1] (docs/contract.md, "Answers").

One row per scorer in :data:`SCORERS`; every module that scores reads it from here
(documents naming a ``scorer``, ``kvdiv pack``, the converters). Pure Python: no torch,
no tokenizer, no third-party metric package, so a leaderboard's predictions are scored
the same way on any machine.

The definitions follow the benchmarks' own, so a score here equals theirs:

* ``ruler_all`` / ``ruler_part``: RULER's string match as kvpress's evaluation applies it
  (``evaluation/benchmarks/ruler/calculate_metrics.py``): the output is stripped, its
  control characters (U+0000..U+001F, newlines included) removed and stripped again;
  then ``all`` is the fraction of the references contained in it and ``part`` is 1 when
  any is, both case-insensitive (``str.lower``). RULER's own scripts replace the
  control characters by a newline instead of removing them; the two differ only when a
  reference would straddle a line break.
* ``exact`` / ``f1``: SQuAD's normalised exact match and token F1 (lower case, punctuation
  and the articles a/an/the removed, whitespace collapsed), the best over the answers,
  as LongBench's ``qa_f1_score`` (kvpress's LongBench scorer) computes F1.
* ``contains``: some answer's normalised words appear as a contiguous run in the
  output's normalised words.
* ``number``: the first number in the output equals some answer's number.

Other scorers come from the entry-point group ``kvdiv.scorers`` (name -> a callable
``(output, answers) -> float``), as presses come from ``kvdiv.presses``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from importlib.metadata import entry_points

from protocols.errors import ProtocolError
from protocols.leaderboard_scoring import LEADERBOARD_ROWS
from protocols.text_match import normalize_answer, token_f1

__all__ = [
    "ENTRY_POINT_GROUP", "SCORERS", "Scorer", "UnknownScorerError", "answer_span", "get_scorer", "normalize_answer",
    "parse_answers", "score", "scorer_names",
]

#: The entry-point group third-party scorers register under (name -> callable).
ENTRY_POINT_GROUP = "kvdiv.scorers"

ScoreFn = Callable[[str, Sequence[str]], float]

_CONTROL = re.compile(r"[\x00-\x1f]")
_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


class UnknownScorerError(ProtocolError, ValueError):
    """A scorer name that is neither built in nor registered under :data:`ENTRY_POINT_GROUP`."""


@dataclass(frozen=True)
class Scorer:
    """One scorer: its name, the function and what it computes.

    Attributes
    ----------
    name : str
        The name documents and datasets carry (``scorer`` field / variable).
    fn : callable
        ``(output, answers) -> float`` in [0, 1].
    description : str
        One line for docs and ``--help``.
    binary : bool
        The score is always 0 or 1 (McNemar's test applies).
    """

    name: str
    fn: ScoreFn
    description: str
    binary: bool = True

    def __call__(self, output: str, answers: Sequence[str]) -> float:
        return self.fn(output, answers)


# ----------------------------------------------------------------------------- normalisation

def _kvpress_clean(output: str) -> str:
    """kvpress's RULER post-processing: strip, drop control characters, strip."""
    return _CONTROL.sub("", output.strip()).strip()


# ----------------------------------------------------------------------------- the scorers

def _ruler_all(output: str, answers: Sequence[str]) -> float:
    pred = _kvpress_clean(output).lower()
    return sum(1.0 for a in answers if a.lower() in pred) / len(answers)


def _ruler_part(output: str, answers: Sequence[str]) -> float:
    pred = _kvpress_clean(output).lower()
    return float(any(a.lower() in pred for a in answers))


def _exact(output: str, answers: Sequence[str]) -> float:
    pred = normalize_answer(output)
    return float(any(normalize_answer(a) == pred for a in answers))


def _contains(output: str, answers: Sequence[str]) -> float:
    pred = f" {normalize_answer(output)} "
    return float(any(norm and f" {norm} " in pred for norm in map(normalize_answer, answers)))


def _as_number(text: str) -> float | None:
    try:
        value = float(text.replace(",", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _number(output: str, answers: Sequence[str]) -> float:
    found = _NUMBER.search(output)
    if found is None:
        return 0.0
    value = _as_number(found.group())
    return float(value is not None and any(_as_number(a.strip()) == value for a in answers))


#: The built-in scorers, one row each.
SCORERS: tuple[Scorer, ...] = (
    Scorer("ruler_all", _ruler_all, "RULER string match (all): the fraction of the answers contained in the output, "
                                    "case-insensitive, as kvpress scores RULER's niah, vt, cwe, fwe", binary=False),
    Scorer("ruler_part", _ruler_part, "RULER string match (part): 1 when any answer is contained in the output, "
                                      "case-insensitive, as kvpress scores RULER's qa"),
    Scorer("exact", _exact, "SQuAD normalised exact match: the normalised output equals a normalised answer"),
    Scorer("contains", _contains, "a normalised answer appears as a run of whole words in the normalised output"),
    Scorer("f1", token_f1, "SQuAD / LongBench token F1 of the normalised words, the best over the answers",
           binary=False),
    Scorer("number", _number, "the first number in the output equals an answer's number (commas ignored)"),
)
#: kvpress's per-row metrics for the benchmarks it scores row by row (protocols.leaderboard_scoring).
SCORERS += tuple(Scorer(name, fn, text, binary) for name, fn, text, binary in LEADERBOARD_ROWS)
_BUILTIN = {s.name: s for s in SCORERS}


@cache
def _plugins() -> dict[str, Scorer]:
    """Scorers registered under :data:`ENTRY_POINT_GROUP` (loaded once; a broken one is skipped)."""
    found: dict[str, Scorer] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _BUILTIN:
            continue   # a built-in name keeps its built-in meaning
        try:
            obj = ep.load()
        except Exception:  # noqa: BLE001 - one broken plugin must not stop scoring with the others
            continue
        if isinstance(obj, Scorer):
            found[ep.name] = obj
        elif callable(obj):
            found[ep.name] = Scorer(ep.name, obj, (obj.__doc__ or ep.value).strip().splitlines()[0], binary=False)
    return found


def scorer_names() -> list[str]:
    """Every scorer name: the built-in ones, then those of installed plugins.

    Parameters
    ----------
    None

    Returns
    -------
    list of str

    Raises
    ------
    None

    Examples
    --------
    >>> scorer_names()[:3]
    ['ruler_all', 'ruler_part', 'exact']
    """
    return [*_BUILTIN, *sorted(_plugins())]


def get_scorer(name: str) -> Scorer:
    """The scorer called ``name``: a built-in one or a ``kvdiv.scorers`` plugin.

    Parameters
    ----------
    name : str
        A scorer name.

    Returns
    -------
    Scorer

    Raises
    ------
    UnknownScorerError
        Naming the known scorers.

    Examples
    --------
    >>> get_scorer("ruler_all").binary
    False
    """
    found = _BUILTIN.get(name) or _plugins().get(name)
    if found is None:
        raise UnknownScorerError(f"unknown scorer {name!r}; known: {', '.join(scorer_names())}")
    return found


def score(name: str, output: str, answers: Sequence[str]) -> float:
    """Score one output against its acceptable answers with the named scorer.

    Parameters
    ----------
    name : str
        A scorer name (:func:`scorer_names`).
    output : str
        The model's decoded answer.
    answers : sequence of str
        The acceptable answers; empty gives NaN (nothing to score against).

    Returns
    -------
    float
        In [0, 1]; NaN when there are no answers.

    Raises
    ------
    UnknownScorerError
        An unknown scorer.
    ValueError
        A plugin's score outside [0, 1].

    Examples
    --------
    >>> score("ruler_all", "The keys are 123 and 456.", ["123", "789"])
    0.5
    >>> score("exact", "The Paris.", ["paris"]), score("number", "It is 1,024 bytes", ["1024"])
    (1.0, 1.0)
    """
    scorer = get_scorer(name)
    if not answers:
        return math.nan
    value = float(scorer(str(output), [str(a) for a in answers]))
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"scorer {name!r} returned {value}, outside [0, 1]")
    return value


def parse_answers(text: str) -> list[str]:
    """The acceptable answers from their stored form: a JSON list of strings.

    Parameters
    ----------
    text : str
        The ``answers`` variable's value for one document.

    Returns
    -------
    list of str

    Raises
    ------
    ValueError
        Not JSON, or not a list of strings.

    Examples
    --------
    >>> parse_answers('["42", "forty-two"]')
    ['42', 'forty-two']
    """
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        raise ValueError(f"answers {str(text)[:60]!r} is not JSON") from None
    if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
        raise ValueError(f"answers {str(text)[:60]!r} is not a JSON list of strings")
    return value


def answer_span(output: str, answers: Sequence[str]) -> int:
    """Where the answer starts in the output: the first character of the earliest
    case-insensitive occurrence of any answer, or -1 when none occurs.

    Used to place P's scored answer among its tokens (``x_answer_start``).

    Parameters
    ----------
    output : str
        The decoded output.
    answers : sequence of str
        The acceptable answers.

    Returns
    -------
    int
        A character offset into ``output``, or -1.

    Raises
    ------
    None

    Examples
    --------
    >>> answer_span("The key is 4711.", ["4711"]), answer_span("no", ["4711"])
    (11, -1)
    """
    low = output.lower()
    hits = [i for i in (low.find(a.lower()) for a in answers if a) if i >= 0]
    return min(hits) if hits else -1
