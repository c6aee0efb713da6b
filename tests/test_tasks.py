"""collector.tasks and ``kvdiv docs --task``: RULER-style task documents, seeded, with answers."""

from __future__ import annotations

import re

import numpy as np
import pytest
from click.testing import CliRunner

from collector import documents as D
from collector.tasks import TASKS, haystack_sentences, task_documents
from protocols.scoring import score


@pytest.mark.parametrize("task", list(TASKS))
def test_documents_hold_their_answers_at_the_target_length(task):
    docs = task_documents(task, 6, target_tokens=300, seed=3)
    assert [d.id for d in docs] == [f"{task}:{i:03d}" for i in range(6)]
    for d in docs:
        assert d.meta["task"] == task and d.meta["scorer"] == "ruler_all" and d.meta["question"]
        assert all(a in d.text for a in d.meta["answers"])
        assert 0.85 * 300 <= d.meta["n_tokens"] <= 1.15 * 300
        assert d.meta["n_tokens"] == D.approx_token_count(d.text)
        assert score("ruler_all", " ".join(d.meta["answers"]), d.meta["answers"]) == 1.0
        assert score("ruler_all", "I do not know", d.meta["answers"]) == 0.0
    assert task_documents(task, 6, target_tokens=300, seed=3) == docs          # seeded
    assert task_documents(task, 6, target_tokens=300, seed=4) != docs


@pytest.mark.parametrize("task", ["passkey", "multikey"])
def test_needle_depths_spread_evenly(task):
    docs = task_documents(task, 9, target_tokens=400)
    depths = np.array([d.meta["needle_depth"] for d in docs])
    assert depths[0] == 0.0 and depths[-1] == 1.0
    assert np.all(np.diff(depths) > 0)
    assert np.max(np.abs(depths - np.linspace(0, 1, 9))) < 0.1


def test_multikey_asks_one_key_among_distractors():
    d = task_documents("multikey", 1, target_tokens=300)[0]
    needles = re.findall(r"special magic numbers for ([a-z]+-[a-z]+) is: (\d+)\.", d.text)
    assert len(needles) == 4 and len({k for k, _ in needles}) == 4
    asked = re.search(r"for ([a-z]+-[a-z]+) mentioned", d.meta["question"]).group(1)
    assert d.meta["answers"] == [v for k, v in needles if k == asked]


def test_multivalue_and_variable_tracking_answers_follow_from_the_text():
    d = task_documents("multivalue", 1, target_tokens=300)[0]
    found = re.findall(r"special magic numbers for [a-z-]+ is: (\d+)\.", d.text)
    assert sorted(found) == sorted(d.meta["answers"]) and len(found) == 4 and "needle_depth" not in d.meta
    d = task_documents("variable-tracking", 1, target_tokens=300)[0]
    value = re.search(r"value (\d+)", d.meta["question"]).group(1)
    holds = {m.group(1) for m in re.finditer(rf"VAR ([A-Z]{{5}}) = {value}\.", d.text)}
    for _ in range(10):   # follow the chain through the text, independently of how it was built
        holds |= {m.group(1) for m in re.finditer(r"VAR ([A-Z]{5}) = VAR ([A-Z]{5})\.", d.text) if m.group(2) in holds}
    assert holds == set(d.meta["answers"]) and len(holds) == 5


def test_haystack_from_the_users_text_and_errors():
    hay = haystack_sentences(["Alpha beta gamma. Delta epsilon!\n\n   code = 1\n\nZeta eta theta."])
    assert hay == ["Alpha beta gamma.", "Delta epsilon!", "Zeta eta theta."]
    d = task_documents("passkey", 2, target_tokens=60, haystack=hay)[0]
    assert "Alpha beta gamma." in d.text and "code" not in d.text
    with pytest.raises(D.DocumentsError, match="too short for passkey"):
        task_documents("passkey", 1, target_tokens=20)
    with pytest.raises(D.DocumentsError, match="unknown task 'nope'"):
        task_documents("nope", 1, target_tokens=100)
    with pytest.raises(D.DocumentsError, match="no prose"):
        haystack_sentences(["    only code\n    here"])


def test_docs_command_writes_task_documents(tmp_path):
    from kvdiv.commands import docs

    out = tmp_path / "pk.jsonl"
    res = CliRunner().invoke(docs, ["--task", "passkey", "--count", "4", "--target-tokens", "200",
                                    "--tokenizer", "approx", "-o", str(out)])
    assert res.exit_code == 0, res.output
    items = D.read_jsonl(out)   # the task fields pass the documents' own checks
    assert [d.meta["needle_depth"] for d in items][::3] == [0.0, 1.0]
    own = tmp_path / "own.txt"
    own.write_text("My own sentence number one. And here is another sentence of mine.\n")
    res = CliRunner().invoke(docs, ["--task", "multivalue", "--count", "2", "--target-tokens", "120",
                                    "--tokenizer", "approx", "--source", str(own), "-o", str(out), "--force"])
    assert res.exit_code == 0, res.output
    items = D.read_jsonl(out)
    assert "My own sentence number one." in items[0].text and items[0].meta["source"] == str(own)
