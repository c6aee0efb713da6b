"""Complete answers under the coupling: /detokenize, the collector decoding P's and Q's answers,
and ``kvdiv pack`` adding the scored answer variables (live servers on loopback)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from service_live import LiveServer

from collector import documents as D
from collector.answers import answer_ids, text_path
from collector.collect import CollectConfig, collect
from collector.errors import PackError
from collector.journal import Journal
from collector.pack import pack_run
from collector.tasks import task_documents
from protocols import eos_ids, validate
from protocols.scoring import score

pytestmark = pytest.mark.service


@pytest.fixture(scope="module")
def tiny() -> Iterator[LiveServer]:
    server = LiveServer()
    try:
        yield server
    finally:
        server.stop()


def test_answer_ids_cut_at_the_first_eos():
    assert answer_ids(np.array([[4, 2, 2], [2, 2, 2], [5, 6, 7]]), [2, 9]) == [[4], [], [5, 6, 7]]


def test_detokenize_route(tiny: LiveServer):
    tok = tiny.service.tokenizer
    ids = tok.encode("ab c", add_special_tokens=False)
    r = httpx.post(tiny.url + "/detokenize", json={"ids": [ids, [], ids[:1]]}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["texts"] == [tok.decode(ids), "", tok.decode(ids[:1])]
    assert body["ends"][0] == [len(tok.decode(ids[:k + 1])) for k in range(len(ids))] and body["ends"][1] == []
    vocab = tiny.service.engine.lm.vocab_size
    for bad, field in (({"ids": [[vocab]]}, "ids[0]"), ({"ids": [[-1]]}, "ids[0]"), ({"ids": [[True]]}, "ids[0]"),
                       ({"ids": [1, 2]}, "ids"), ({}, "ids"), ({"ids": [], "idz": 1}, "idz")):
        r = httpx.post(tiny.url + "/detokenize", json=bad, timeout=30)
        assert r.status_code == 422 and field in r.text, (bad, r.text)


def _docs(tmp_path: Path) -> Path:
    docs = task_documents("passkey", 3, target_tokens=60)
    docs.append(D.Document("plain", "A document without answers. " * 5, {}))
    return D.write_jsonl(docs, tmp_path / "docs.jsonl")


def _cfg(url: str, docs: Path, out: Path, **kw) -> CollectConfig:
    base = dict(servers=[url], docs_file=docs, policies=["snapkv@0.5", "recent@0.5"], out=out, kind="coupled",
                replicates=2, max_new_tokens=6, seed=5, progress=False, template="qa")
    return CollectConfig.flat(**{**base, **kw})


def test_collect_decodes_and_pack_scores_the_answers(tiny: LiveServer, tmp_path: Path):
    docs = _docs(tmp_path)
    run = tmp_path / "run"
    assert collect(_cfg(tiny.url, docs, run)).ok
    ds = validate(pack_run(run, progress=False))
    tok = tiny.service.tokenizer
    eos = eos_ids(ds.attrs)
    items = D.read_jsonl(docs)
    for i, doc in enumerate(items):
        for j in range(ds.sizes["policy"]):
            for r in range(ds.sizes["replicate"]):
                for side in ("x", "y"):
                    tokens = answer_ids(ds[f"{side}_token"].values[i, j, r][None], eos)[0]
                    text = str(ds[f"{side}_text"].values[i, j, r])
                    if "answers" not in doc.meta:   # no answers: unscored, no text
                        assert text == "" and math.isnan(ds[f"{side}_score"].values[i, j, r])
                        continue
                    assert text == tok.decode(tokens, skip_special_tokens=True)   # the model's own tokenizer
                    assert ds[f"{side}_score"].values[i, j, r] == score("ruler_all", text, doc.meta["answers"])
    assert [json.loads(a) for a in ds.answers.values] == [d.meta.get("answers", []) for d in items]
    assert list(ds.scorer.values) == ["ruler_all"] * 3 + [""] and list(ds.task.values) == ["passkey"] * 3 + [""]
    np.testing.assert_array_equal(ds.needle_depth.values[:3], [d.meta["needle_depth"] for d in items[:3]])
    assert ds.x_answer_start.dtype == np.int32 and ds.x_answer_start.values.min() >= -1


def test_pack_refuses_undecoded_answers_and_a_rerun_decodes_them(tiny: LiveServer, tmp_path: Path):
    docs = _docs(tmp_path)
    run = tmp_path / "run"
    assert collect(_cfg(tiny.url, docs, run)).ok
    journal = Journal(run)
    first = D.read_jsonl(docs)[0].id
    gone = text_path(journal, first, "recent@0.5")
    gone.unlink()
    with pytest.raises(PackError, match=f"{first} × recent@0.5: its answers are not decoded.*rerun"):
        pack_run(run, progress=False)
    again = collect(_cfg(tiny.url, docs, run))
    assert again.ok and again.completed == 0 and gone.exists()
    pack_run(run, progress=False)
    # a stale record (its request file changed since) counts as missing
    record = json.loads(gone.read_text())
    gone.write_text(json.dumps({**record, "request_sha256": "0" * 64}))
    with pytest.raises(PackError, match="not decoded"):
        pack_run(run, progress=False)


def test_no_server_to_decode_with_leaves_the_collection_complete(tiny: LiveServer, tmp_path: Path, capsys):
    docs = _docs(tmp_path)
    run = tmp_path / "run"
    assert collect(_cfg(tiny.url, docs, run)).ok
    for p in (run / "answers").iterdir():
        p.unlink()
    result = collect(_cfg("http://127.0.0.1:9", docs, run, wait_for_servers_s=0.1))
    assert result.ok and "answers: 6 of 6 requests not decoded" in capsys.readouterr().err


@pytest.mark.parametrize("suffix", [".zarr", ".nc"])
def test_pack_to_a_file_keeps_the_answers(tiny: LiveServer, tmp_path: Path, suffix: str):
    from collector.pack import pack_to
    from protocols import open_traces

    docs = _docs(tmp_path)
    run = tmp_path / "run"
    assert collect(_cfg(tiny.url, docs, run)).ok
    whole = pack_run(run, progress=False)
    out = pack_to(run, tmp_path / f"t{suffix}", progress=False, batch_mib=0).path
    back = open_traces(out)
    for name in ("x_score", "y_score", "x_text", "y_text", "x_answer_start", "answers", "scorer", "task",
                 "needle_depth"):
        np.testing.assert_array_equal(back[name].values, whole[name].values)


@pytest.mark.model
def test_smollm2_answers_pass_keys_end_to_end(tmp_path: Path):
    """The embedded SmolLM2, greedy, on three short pass-key documents: P's decoded answers hold keys."""
    pytest.importorskip("gguf")
    from kvdiv.demo_documents import load_tokenizer

    docs = D.write_jsonl(task_documents("passkey", 3, target_tokens=150, tokenizer=load_tokenizer("embedded")),
                         tmp_path / "pk.jsonl")
    server = LiveServer("embedded")
    try:
        result = collect(_cfg(server.url, docs, tmp_path / "run", policies=["snapkv@0.5"], replicates=1,
                              max_new_tokens=16, temperature=0.0))
    finally:
        server.stop()
    assert result.ok
    ds = validate(pack_run(tmp_path / "run", progress=False))
    keys = [json.loads(a)[0] for a in ds.answers.values]
    texts = [str(t) for t in ds.x_text.values[:, 0, 0]]
    assert ds.x_score.values.sum() >= 2, texts                   # the full model finds the keys
    for key, text, score_, start in zip(keys, texts, ds.x_score.values[:, 0, 0], ds.x_answer_start.values[:, 0, 0],
                                        strict=True):
        assert score_ == float(key in text)
        if score_:   # the step where the key starts: decoding from there on gives the key first
            tokens = ds.x_token.values[keys.index(key), 0, 0]
            tail = load_tokenizer("embedded").decode(tokens[start:].tolist(), skip_special_tokens=True)
            assert tail.lstrip().startswith(key[:1]) and key in tail
