"""The per-row scores kvpress's evaluation harness computes, for the benchmarks it scores row by row.

kvpress (``evaluation/benchmarks/<name>/calculate_metrics.py``) averages a per-row
score over a task; :func:`kvpress_scorer` says which of kvdiv's scorers
(``protocols.scoring``) gives that per-row score for a (dataset, task), so that a
leaderboard's ``metrics.json`` is the mean of the scores kvdiv computes row by row.
The functions here are the per-row scores that are not already general scorers,
each written from kvpress's definition (not copied); they are used through
``protocols.scoring`` under the names in :data:`LEADERBOARD_ROWS`. The fixture of
tests/test_protocols_kvpress.py checks them against kvpress's own code: its
metrics.json files, computed by kvpress, equal kvdiv's means.

ROUGE is the ``rouge`` package's (1.0.1, which kvpress uses): sentences split at
``.``, words at single spaces, unigram sets (not counts), ROUGE-L at summary level
with the union of each sentence pair's longest common subsequence, backtracked as
that package does. Code similarity is fuzzywuzzy's ``ratio`` without
python-Levenshtein (kvpress's ``eval`` extra does not install it): difflib's
``SequenceMatcher`` ratio, rounded to a percent.

Not built in (the conversion refuses such a dataset or task, naming it): LongBench's
classification (it needs the task's class list), the Chinese tasks (jieba's word
segmentation), and InfiniteBench's code_debug, math_find and math_calc.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence

from protocols.errors import ProtocolError
from protocols.text_match import token_f1

__all__ = ["LEADERBOARD_ROWS", "UnscorableError", "kvpress_scorer"]


class UnscorableError(ProtocolError, ValueError):
    """A (dataset, task) whose kvpress metric kvdiv does not compute."""


_DIGITS = re.compile(r"\d+")
_RETRIEVAL_PUNCT = ("\n", ":", '"', "'", ".", ",", "?", "!", "{", "}")


def _boxed(output: str, index: int) -> str | None:
    parts = output.split("boxed{")
    if index >= len(parts):
        return None
    return parts[index].split("}")[0]


def _boxed_last(output: str, answers: Sequence[str]) -> float:
    """AIME25 (kvpress): the text of the last ``boxed{...}`` (the whole output when none) equals the answer."""
    return float(any(_boxed(output, -1) == str(a) for a in answers))


def _boxed_first(output: str, answers: Sequence[str]) -> float:
    """MATH500 (kvpress): the text of the first ``boxed{...}`` equals the answer (0 when there is none)."""
    return float(any(_boxed(output, 1) == str(a) for a in answers))


def _share_equal(numbers: list[str], wanted: str) -> float:
    return 0.0 if not numbers else sum(n == wanted for n in numbers) / len(numbers)


def _longbench_count(output: str, answers: Sequence[str]) -> float:
    """LongBench passage_count: the share of the output's integers equal to the answer (best answer)."""
    numbers = _DIGITS.findall(output)
    return max((_share_equal(numbers, str(a)) for a in answers), default=0.0)


def _longbench_retrieval(output: str, answers: Sequence[str]) -> float:
    """LongBench passage_retrieval_en: the share of the output's integers equal to the answer's
    ``Paragraph N`` number (best answer)."""
    numbers = _DIGITS.findall(output)
    best = 0.0
    for a in answers:
        found = re.findall(r"Paragraph (\d+)", a)
        if found:
            best = max(best, _share_equal(numbers, found[0]))
    return best


def _rouge_l_first_line(output: str, answers: Sequence[str]) -> float:
    """LongBench's samsum: ROUGE-L F of the output's first line."""
    return _rouge_l(output.lstrip().split("\n")[0], answers)


def _f1_first_line(output: str, answers: Sequence[str]) -> float:
    """LongBench's token F1 on the output's first line (its triviaqa: the model runs on)."""
    return token_f1(output.lstrip().split("\n")[0], answers)


def _leading_digits(output: str) -> str:
    return next((item for item in re.split("[^0-9]", output) if item), "")


def _first_int(output: str, answers: Sequence[str]) -> float:
    """InfiniteBench passkey and number_string: the output's first run of digits equals the answer."""
    return float(bool(answers) and _leading_digits(output) == str(answers[0]))


def _kv_retrieval(output: str, answers: Sequence[str]) -> float:
    """InfiniteBench kv_retrieval: the answer is one of the output's words (split at punctuation too)."""
    for c in _RETRIEVAL_PUNCT:
        output = output.replace(c, " ")
    return float(bool(answers) and str(answers[0]) in output.split())


def _dialogue_contains(output: str, answers: Sequence[str]) -> float:
    """InfiniteBench longdialogue_qa_eng: an answer appears in the output, upper-cased both."""
    pred = output.strip().upper()
    return float(any(str(a).upper() in pred for a in answers))


def _choice_letter(output: str, answers: Sequence[str]) -> float:
    """InfiniteBench longbook_choice_eng: the option letter the output gives is among the answers."""
    pred = output.strip()
    match = re.search(r"\b[A-D]\b(?!.*\b[A-D]\b)", pred)
    if match and match.group(0) in answers:
        return 1.0
    if not pred:
        return 0.0
    if pred[0] in "ABCD":
        return float(pred[0] in answers)
    if pred in answers:
        return 1.0
    for c in ("\n", '"', "'", ".", ",", "?", "!", "{", "}"):
        pred = pred.replace(c, " ")
    while "  " in pred:
        pred = pred.replace("  ", " ")
    for prefix in ("answer is:", "answer:", "answer is", "option is"):
        idx = pred.find(prefix)
        if idx == -1:
            continue
        if len(pred) < idx + len(prefix) + 1:
            return 0.0
        after = pred[idx + len(prefix) + 1:]
        return float(any(after.startswith(s) for s in answers))
    return next((float(word in answers) for word in pred.split() if word in "ABCD"), 0.0)


def _sentences(text: str) -> list[str]:
    """The ``rouge`` package's sentences: pieces between dots, whitespace runs made single spaces."""
    return [" ".join(piece.split()) for piece in text.split(".") if len(piece) > 0]


def _words(sentences: Sequence[str]) -> list[str]:
    return [w for sentence in sentences for w in sentence.split(" ")]


def _lcs_words(x: list[str], y: list[str]) -> set[str]:
    """The words of x and y's longest common subsequence, backtracked as the ``rouge`` package does
    (a match first, then up when the cell above is strictly larger, else left)."""
    n, m = len(x), len(y)
    table = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            table[i][j] = table[i - 1][j - 1] + 1 if x[i - 1] == y[j - 1] else max(table[i - 1][j], table[i][j - 1])
    found: set[str] = set()
    i, j = n, m
    while i > 0 and j > 0:
        if x[i - 1] == y[j - 1]:
            found.add(x[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return found


def _f(overlap: int, n_hyp: int, n_ref: int) -> float:
    p = overlap / n_hyp if n_hyp else 0.0
    r = overlap / n_ref if n_ref else 0.0
    return 2.0 * ((p * r) / (p + r + 1e-8))


def _rouge_l_f(hyp: str, ref: str) -> float | None:
    """ROUGE-L F (summary level) of the ``rouge`` package; None where it raises (an empty text)."""
    hs, rs = _sentences(hyp), _sentences(ref)
    if not hs or not rs:
        return None
    union: set[str] = set()
    for r in rs:
        for h in hs:
            union |= _lcs_words(r.split(" "), h.split(" "))
    return _f(len(union), len(set(_words(hs))), len(set(_words(rs))))


def _rouge_l(output: str, answers: Sequence[str]) -> float:
    """LongBench's rouge_score: ROUGE-L F of the output against an answer, 0 where ROUGE fails; the best answer.

    (The package backtracks recursively, so kvpress scores 0 for a sentence pair of about 1,000 words in all,
    where Python's recursion limit stops it; kvdiv computes the value.)"""
    return max((_rouge_l_f(output.lstrip(), str(a)) or 0.0 for a in answers), default=0.0)


def _needle_rouge_l(output: str, answers: Sequence[str]) -> float:
    """needle_in_haystack: ROUGE-L F with the needle as the hypothesis and the stripped output as the
    reference, as kvpress calls the package (an empty output scores 0; kvpress's run stops there)."""
    return max((_rouge_l_f(str(a).strip(), output.strip()) or 0.0 for a in answers), default=0.0)


def _code_sim(output: str, answers: Sequence[str]) -> float:
    """LongBench lcc / repobench-p: fuzzywuzzy's ratio of the first line without a backtick, ``#`` or
    ``//`` (empty when none) and the answer, over 100."""
    line = next((ln for ln in output.lstrip().split("\n") if "`" not in ln and "#" not in ln and "//" not in ln),
                "")
    best = 0.0
    for a in map(str, answers):
        if line == a:
            ratio = 100
        elif not line or not a:
            ratio = 0
        else:
            ratio = int(round(100 * difflib.SequenceMatcher(None, line, a).ratio()))
        best = max(best, ratio / 100)
    return best


#: LongBench task -> scorer; absent tasks are refused with the metric kvpress uses.
_LONGBENCH = {
    "narrativeqa": "f1", "qasper": "f1", "multifieldqa_en": "f1", "hotpotqa": "f1", "2wikimqa": "f1",
    "musique": "f1", "triviaqa": "f1_first_line", "passage_count": "longbench_count",
    "passage_retrieval_en": "longbench_retrieval", "gov_report": "rouge_l", "qmsum": "rouge_l",
    "multi_news": "rouge_l", "samsum": "rouge_l_first_line", "lcc": "code_sim", "repobench-p": "code_sim",
}
_LONGBENCH_REFUSED = {
    "dureader": "ROUGE-L on jieba words", "vcsum": "ROUGE-L on jieba words", "multifieldqa_zh": "F1 on jieba words",
    "trec": "classification against the task's class list", "lsht": "classification against the task's class list",
    "passage_retrieval_zh": "retrieval of 段落N",
}
_INFINITEBENCH = {
    "passkey": "first_int", "number_string": "first_int", "kv_retrieval": "kv_retrieval",
    "kv_retrieval_prefix": "kv_retrieval", "kv_retrieval_both": "kv_retrieval", "longbook_qa_eng": "f1",
    "longdialogue_qa_eng": "dialogue_contains", "longbook_choice_eng": "choice_letter",
}


def kvpress_scorer(dataset: str, task: str) -> str:
    """The scorer (a ``protocols.scoring`` name) whose per-row score kvpress averages for (dataset, task).

    Parameters
    ----------
    dataset : str
        kvpress's dataset name (``ruler``, ``longbench``, ``infinitebench``, ``aime25``, ...).
    task : str
        The row's ``task`` (RULER's ``niah_single_1``, LongBench's ``hotpotqa``, ...).

    Returns
    -------
    str
        A scorer name.

    Raises
    ------
    UnscorableError
        kvpress scores the (dataset, task) with a metric kvdiv does not compute (named).

    Examples
    --------
    >>> kvpress_scorer("ruler", "qa_2"), kvpress_scorer("ruler", "niah_multikey_1")
    ('ruler_part', 'ruler_all')
    >>> kvpress_scorer("longbench", "hotpotqa")
    'f1'
    """
    if dataset == "ruler":
        return "ruler_part" if task.split("_")[0] == "qa" else "ruler_all"
    if dataset in ("longbench", "longbench-e"):
        name = task.removesuffix("-e")
        if name in _LONGBENCH:
            return _LONGBENCH[name]
        metric = _LONGBENCH_REFUSED.get(name, "an unknown metric")
        raise UnscorableError(f"kvpress scores LongBench's {name!r} with {metric}, which kvdiv does not compute")
    if dataset == "infinitebench":
        if task in _INFINITEBENCH:
            return _INFINITEBENCH[task]
        raise UnscorableError(f"kvdiv does not compute InfiniteBench's {task!r} metric")
    if dataset == "aime25":
        return "boxed_last"
    if dataset == "math500":
        return "boxed_first"
    if dataset == "needle_in_haystack":
        return "needle_rouge_l"
    metric = {"loogle": "its own metrics", "zero_scrolls": "its own metrics",
              "longbench-v2": "multiple-choice accuracy"}.get(dataset, "a metric kvdiv does not know")
    raise UnscorableError(f"kvpress scores dataset {dataset!r} with {metric}, which kvdiv does not compute")


#: The scorers above as rows of ``protocols.scoring.SCORERS``: (name, function, description, binary).
LEADERBOARD_ROWS: tuple[tuple[str, object, str, bool], ...] = (
    ("boxed_last", _boxed_last, "AIME25 as kvpress scores it: the last boxed{...} equals the answer", True),
    ("boxed_first", _boxed_first, "MATH500 as kvpress scores it: the first boxed{...} equals the answer", True),
    ("longbench_count", _longbench_count,
     "LongBench passage_count: the share of the output's integers equal to the answer", False),
    ("longbench_retrieval", _longbench_retrieval,
     "LongBench passage_retrieval_en: the share of the output's integers equal to the answer's paragraph", False),
    ("f1_first_line", _f1_first_line, "token F1 of the output's first line (LongBench triviaqa)", False),
    ("first_int", _first_int, "InfiniteBench passkey / number_string: the first digits in the output equal the answer",
     True),
    ("kv_retrieval", _kv_retrieval, "InfiniteBench kv_retrieval: the answer is a word of the output", True),
    ("dialogue_contains", _dialogue_contains,
     "InfiniteBench longdialogue_qa_eng: an answer appears in the output (upper-cased)", True),
    ("choice_letter", _choice_letter, "InfiniteBench longbook_choice_eng: the option letter given is an answer", True),
    ("rouge_l", _rouge_l, "ROUGE-L F at summary level, as the rouge package (LongBench's summaries)", False),
    ("rouge_l_first_line", _rouge_l_first_line, "ROUGE-L F of the output's first line (LongBench samsum)", False),
    ("needle_rouge_l", _needle_rouge_l,
     "needle in a haystack as kvpress scores it: ROUGE-L F, the needle as hypothesis, the output as reference", False),
    ("code_sim", _code_sim, "LongBench lcc / repobench-p: fuzzywuzzy ratio of the first code line", False),
)
