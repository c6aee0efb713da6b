"""Document sets: deterministic paragraph chunking, sources, selection, prompt templates."""

from __future__ import annotations

import json

import pytest

from collector import documents as D


def _count_words(text: str) -> int:
    return len(text.split())


def test_chunks_are_whole_paragraphs_within_target() -> None:
    paras = [" ".join(f"w{i}_{j}" for j in range(n)) for i, n in enumerate([5, 7, 3, 9, 2, 6, 4])]
    text = "\n\n".join(paras)
    chunks = D.chunk_text(text, _count_words, target=12)
    assert all(_count_words(c) <= 12 for c in chunks)
    # Re-joining gives back the source, and every chunk piece is one of its paragraphs.
    assert "\n\n".join(chunks) == text
    assert all(p in paras for c in chunks for p in c.split("\n\n"))
    # Greedy: no two neighbouring chunks could have been merged within the target.
    assert all(_count_words(a) + _count_words(b) > 12 for a, b in zip(chunks, chunks[1:], strict=False))


def test_long_paragraph_is_cut_at_line_boundaries() -> None:
    para = "\n".join(" ".join(["x"] * 4) for _ in range(6))  # 24 words on 6 lines
    chunks = D.chunk_text("intro words here\n\n" + para, _count_words, target=10)
    assert chunks[0] == "intro words here"
    assert all(_count_words(c) <= 10 for c in chunks)
    assert all(line == "x x x x" for c in chunks[1:] for line in c.split("\n") if line)


def test_pydoc_documents_are_deterministic_and_sized() -> None:
    a = D.pydoc_documents(_count_words, target_tokens=120)
    b = D.pydoc_documents(_count_words, target_tokens=120)
    assert [d.to_json() for d in a] == [d.to_json() for d in b]
    assert len(a) > 100
    ids = [d.id for d in a]
    assert len(set(ids)) == len(ids)
    assert all(i.startswith("pydoc:") and i.count(":") == 2 for i in ids)
    assert all(60 <= d.meta["n_tokens"] <= 120 for d in a)
    assert all(d.meta["n_tokens"] == _count_words(d.text) for d in a)
    from pydoc_data.topics import topics

    for doc in a[:40]:  # every chunk's paragraphs come from its topic, verbatim
        assert all(p in topics[doc.meta["topic"]] for p in doc.text.split("\n\n"))


def test_select_is_a_stable_spread_subset() -> None:
    docs = D.pydoc_documents(None, target_tokens=150)
    pick = D.select(docs, 10)
    assert [d.id for d in pick] == [d.id for d in D.select(docs, 10)]
    assert len(pick) == 10 and len({d.meta["topic"] for d in pick}) > 5
    assert D.select(docs, None) == docs


def test_token_counter_accepts_tokenizers_and_callables() -> None:
    class Tok:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            assert add_special_tokens is False
            return list(range(len(text)))

    assert D.token_counter(Tok())("abc") == 3
    assert D.token_counter(len)("abcd") == 4
    assert D.token_counter(None)("a, b") == 3
    with pytest.raises(TypeError):
        D.token_counter(42)


def test_user_sources_jsonl_and_txt(tmp_path) -> None:
    src = tmp_path / "docs.jsonl"
    src.write_text(json.dumps({"id": "a", "text": "one\n\ntwo three", "lang": "en"}) + "\n\n"
                   + json.dumps({"id": "b", "text": "four"}) + "\n")
    docs = D.load_source(str(src), _count_words)
    assert [d.id for d in docs] == ["a", "b"] and docs[0].meta == {"lang": "en", "n_tokens": 3}
    chunked = D.load_source(str(src), _count_words, target_tokens=1, chunk=True)
    assert [d.id for d in chunked] == ["a:0", "a:1", "b:0"]
    folder = tmp_path / "txt"
    folder.mkdir()
    (folder / "z.txt").write_text("zed\n")
    (folder / "m.txt").write_text("em\n")
    assert [d.id for d in D.load_source(str(folder))] == ["m", "z"]
    src.write_text(json.dumps({"id": "a", "text": "x"}) + "\n" + json.dumps({"id": "a", "text": "y"}) + "\n")
    with pytest.raises(ValueError, match="duplicate"):
        D.read_jsonl(src)
    src.write_text('{"text": "no id"}\n')
    with pytest.raises(ValueError, match=":1:"):
        D.read_jsonl(src)


def test_write_and_read_round_trip(tmp_path) -> None:
    docs = D.select(D.pydoc_documents(None, target_tokens=100), 5)
    path = D.write_jsonl(docs, tmp_path / "d.jsonl")
    assert D.read_jsonl(path) == docs
    assert len(D.file_sha256(path)) == 64


def test_templates_put_the_instruction_last() -> None:
    doc = D.Document("d", "Body text.", {"question": "Why?"})
    summ = D.render_messages(doc, "summarise")
    qa = D.render_messages(doc, "qa")
    assert summ[0]["role"] == "user" and summ[0]["content"].startswith("Body text.")
    assert summ[0]["content"].rstrip().endswith("sentences.")
    assert qa[0]["content"].endswith("Question: Why?")
    assert D.DEFAULT_QUESTION in D.render_messages(D.Document("e", "x"), "qa")[0]["content"]
    with pytest.raises(ValueError, match="unknown template"):
        D.render_messages(doc, "poem")


def test_docs_command_writes_a_counted_subset(tmp_path) -> None:
    from click.testing import CliRunner

    from kvdiv.commands import docs

    out = tmp_path / "d.jsonl"
    res = CliRunner().invoke(docs, ["-o", str(out), "--tokenizer", "approx", "--target-tokens", "90",
                                    "--count", "7"])
    assert res.exit_code == 0, res.output
    items = D.read_jsonl(out)
    assert len(items) == 7 and all(45 <= d.meta["n_tokens"] <= 90 for d in items)
    before = out.read_bytes()
    res = CliRunner().invoke(docs, ["-o", str(out), "--tokenizer", "approx", "--count", "2"])
    assert res.exit_code != 0 and "--force" in res.output and out.read_bytes() == before
    res = CliRunner().invoke(docs, ["-o", str(out), "--source", str(tmp_path / "missing.jsonl"),
                                    "--tokenizer", "approx", "--force"])
    assert res.exit_code != 0 and "missing.jsonl" in res.output
    res = CliRunner().invoke(docs, ["-o", str(out), "--tokenizer", "approx", "--count", "2", "--force"])
    assert res.exit_code == 0, res.output
    assert len(D.read_jsonl(out)) == 2


def test_docs_counts_tokens_through_a_server_without_torch(tmp_path) -> None:
    import subprocess
    import sys

    from test_collector_support import FakeServer

    src = D.write_jsonl([D.Document("a", "one two three"), D.Document("b", "four five")], tmp_path / "src.jsonl")
    out = tmp_path / "d.jsonl"
    probe = ("import sys; from kvdiv.cli import main\n"
             "try:\n    main(sys.argv[1:], standalone_mode=False)\nexcept SystemExit:\n    pass\n"
             "print('HEAVY=' + ','.join(m for m in ('torch', 'transformers') if m in sys.modules))")
    with FakeServer() as server:
        run = subprocess.run([sys.executable, "-c", probe, "docs", "--source", str(src), "-o", str(out),
                              "--server", server.url], capture_output=True, text=True, timeout=120)
    assert "HEAVY=\n" in run.stdout, run.stdout + run.stderr
    assert [d.meta["n_tokens"] for d in D.read_jsonl(out)] == [3, 2]   # the server's BOS is not counted
    with pytest.raises(D.DocumentsError, match="/tokenize"):
        D.server_token_counter("http://127.0.0.1:9", timeout_s=2)("text")


@pytest.mark.parametrize(("fields", "message"), [
    ({"answers": [1, 2]}, "field 'answers': expected a list of strings, got [1, 2]"),
    ({"scorer": "exact"}, "field 'scorer': a scorer is asked but the document has no 'answers'"),
    ({"answers": ["a"], "scorer": "rouge9"}, "field 'scorer': unknown scorer 'rouge9'; known: ruler_all, ruler_part"),
    ({"answers": ["a"], "needle_depth": 1.5}, "field 'needle_depth': expected a number in [0, 1], got 1.5"),
    ({"answers": ["a"], "task": 3}, "field 'task': expected a string, got 3"),
])
def test_task_fields_are_checked_naming_file_line_and_field(tmp_path, fields, message) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"id": "ok", "text": "t", "answers": ["x"]}) + "\n"
                    + json.dumps({"id": "bad", "text": "t", **fields}) + "\n")
    with pytest.raises(D.DocumentsError) as err:
        D.read_jsonl(path)
    assert str(err.value).startswith(f"{path}:2: {message}")


def test_task_fields_are_kept_and_one_answer_is_a_list(tmp_path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"id": "a", "text": "t", "answers": "4711", "scorer": "number", "task": "passkey",
                                "needle_depth": 0.25}) + "\n")
    doc = D.read_jsonl(path)[0]
    assert doc.meta == {"answers": ["4711"], "scorer": "number", "task": "passkey", "needle_depth": 0.25}
