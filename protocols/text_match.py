"""SQuAD's answer normalisation and token F1: the text matching that the task scorers share.

Both :mod:`protocols.scoring` (the scorer table) and :mod:`protocols.leaderboard_scoring`
(the scorers kvpress averages per dataset) build on these, so they sit below both.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

__all__ = ["normalize_answer", "token_f1"]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces.

    Parameters
    ----------
    text : str
        Any text.

    Returns
    -------
    str
        The normalised text.

    Raises
    ------
    None

    Examples
    --------
    >>> normalize_answer("The  Cat, sat!")
    'cat sat'
    """
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _f1_one(pred: list[str], gold: list[str]) -> float:
    same = sum((Counter(pred) & Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def token_f1(output: str, answers: Sequence[str]) -> float:
    """SQuAD / LongBench token F1 of the normalised words, the best over the answers.

    Parameters
    ----------
    output : str
        The model's answer.
    answers : sequence of str
        The acceptable answers (at least one).

    Returns
    -------
    float
        The F1 in [0, 1].

    Raises
    ------
    ValueError
        If ``answers`` is empty (the best over no answers is undefined).

    Examples
    --------
    >>> token_f1("the cat sat", ["a cat sat down"])
    0.8
    """
    pred = normalize_answer(output).split()
    return max(_f1_one(pred, normalize_answer(a).split()) for a in answers)
