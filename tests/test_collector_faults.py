"""Fault injection: a hostile or broken server never hangs a collection, never loses what
was collected and never gets a wrong request into a dataset; the next resume completes.

Each case injects one fault into one request of a small run (3 documents × 2 policies)
through the fake server of test_collector_support.py, whose hostile streams carry a
fresh, valid digest (a rewriting proxy or a buggy server, not line noise):

- transient faults (connection drops, dripped bytes, garbage encodings, huge integers,
  deep nesting, bytes that are not UTF-8, overlong lines) are retried and the run
  finishes complete, byte-identical to a fault-free run;
- permanent faults (a rewritten request, altered header fields, an int32-overflowing
  budget, a 422) end that request after one attempt with a reason naming the field;
  nothing of it reaches the journal's complete files, ``pack`` refuses the gap, and
  rerunning ``collect`` against an honest server completes the run.

Every case is bounded in time (``pytest.mark.timeout``): before these fixes several of
them hung ``collect`` forever.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from test_collector_support import BYTE_FAULTS, HEADER_EDITS, REWRITES, FakeServer

from collector import documents as D
from collector.collect import CollectConfig, collect
from collector.errors import CollectorError
from collector.pack import PackError, pack_run

POLICIES = ["snapkv@0.5", "recent@0.5"]
TARGET = ("doc1", "recent@0.5")   # the request that gets the fault (not the run's first)

TRANSIENT = ["drop", "truncate", "bad_digest", "error", "429", "500", *BYTE_FAULTS]
PERMANENT = {  # fault -> words the failure reason must contain
    "rewrite_policy": "candidate",
    "rewrite_temperature": "temperature",
    "rewrite_seed": "seed",
    "rewrite_prompt": "prompt",
    "rewrite_doc": "doc",
    "rewrite_kind_sizes": "replicates",
    "header_reference": "reference",
    "header_model": "model",
    "header_prompt_tokens": "prompt",
    "header_no_prompt_sha256": "prompt_sha256",
    "budget_overflow": "budget",
    "422": "HTTP 422",
    "error_validation": "validation",
}
assert set(PERMANENT) | set(TRANSIENT) >= {*REWRITES, *HEADER_EDITS, *BYTE_FAULTS}


@pytest.fixture()
def docs_file(tmp_path: Path) -> Path:
    docs = [D.Document(f"doc{i}", f"Paragraph {i} of the test set.\n\nSecond paragraph {i}.") for i in range(3)]
    return D.write_jsonl(docs, tmp_path / "docs.jsonl")


def _cfg(servers: list[str], docs_file: Path, out: Path, **kw) -> CollectConfig:
    base = dict(servers=servers, docs_file=docs_file, policies=POLICIES, out=out, kind="residual",
                replicates=2, max_new_tokens=6, window=4, seed=7, progress=False, backoff_s=0.01,
                backoff_max_s=0.05, max_attempts=3, request_timeout_s=2.0, concurrency=1)
    base.update(kw)
    return CollectConfig.flat(**base)


def _journal(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run / "requests").glob("*.ndjson"))}


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    tmp = tmp_path_factory.mktemp("clean")
    docs = [D.Document(f"doc{i}", f"Paragraph {i} of the test set.\n\nSecond paragraph {i}.") for i in range(3)]
    docs_file = D.write_jsonl(docs, tmp / "docs.jsonl")
    with FakeServer() as server:
        assert collect(_cfg([server.url], docs_file, tmp / "run")).ok
    return tmp / "run", _journal(tmp / "run")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault", TRANSIENT)
def test_transient_fault_is_retried_to_the_clean_result(fault: str, docs_file: Path, tmp_path: Path,
                                                        clean_run: tuple[Path, dict[str, bytes]]) -> None:
    with FakeServer() as server:
        server.faults_for = {TARGET: [fault]}
        start = time.monotonic()
        result = collect(_cfg([server.url], docs_file, tmp_path / "run"))
        took = time.monotonic() - start
        asked = [r for r in server.requests if (r["doc_id"], r["candidate"]) == TARGET]
    assert result.ok, result.summary()
    assert len(asked) == 2 and result.retries == 1 and took < 20
    assert _journal(tmp_path / "run") == clean_run[1]   # nothing damaged was kept
    assert not list((tmp_path / "run" / "requests").glob("*.ndjson.part"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault", sorted(PERMANENT))
def test_permanent_fault_fails_once_reaches_no_dataset_and_resume_completes(
        fault: str, docs_file: Path, tmp_path: Path, clean_run: tuple[Path, dict[str, bytes]]) -> None:
    run = tmp_path / "run"
    with FakeServer() as server:
        server.faults_for = {TARGET: [fault]}
        start = time.monotonic()
        result = collect(_cfg([server.url], docs_file, run, max_attempts=6))
        took = time.monotonic() - start
        asked = [r for r in server.requests if (r["doc_id"], r["candidate"]) == TARGET]
    assert not result.ok and took < 20
    assert len(asked) == 1, "a permanent failure must not be retried"
    reason = result.failed[f"{TARGET[0]} × {TARGET[1]}"]
    assert PERMANENT[fault] in reason, reason
    # Nothing of the wrong request is complete; pack names the gap instead of packing it.
    with pytest.raises(PackError, match=r"doc1: .*recent@0\.5"):
        pack_run(run, progress=False)
    # The next resume (an honest server) completes the run to the fault-free bytes.
    with FakeServer() as server:
        again = collect(_cfg([server.url], docs_file, run))
    assert again.ok, again.summary()
    assert _journal(run) == clean_run[1]
    assert pack_run(run, progress=False).identical(pack_run(clean_run[0], progress=False))


@pytest.mark.timeout(60)
def test_a_copied_request_file_is_set_aside_and_recollected(docs_file: Path, tmp_path: Path,
                                                            clean_run: tuple[Path, dict[str, bytes]]) -> None:
    run = tmp_path / "run"
    with FakeServer() as server:
        assert collect(_cfg([server.url], docs_file, run)).ok
        files = sorted((run / "requests").glob("*.ndjson"))
        files[1].write_bytes(files[0].read_bytes())  # digest still valid, wrong (doc, policy) slot
        with pytest.raises(PackError, match=files[1].name):
            pack_run(run, progress=False)
        server.requests.clear()
        again = collect(_cfg([server.url], docs_file, run))
        assert again.ok and again.completed == 1 and len(server.requests) == 1
    assert _journal(run) == clean_run[1]
    assert list((run / "requests").glob(files[1].name + ".rejected*"))  # set aside, not deleted


@pytest.mark.timeout(60)
@pytest.mark.parametrize("damage", ["deep_nesting", "huge_int", "not_json"])
def test_a_damaged_journal_line_is_named_by_pack_and_repaired_by_collect(
        damage: str, docs_file: Path, tmp_path: Path, clean_run: tuple[Path, dict[str, bytes]]) -> None:
    run = tmp_path / "run"
    with FakeServer() as server:
        assert collect(_cfg([server.url], docs_file, run)).ok
        victim = sorted((run / "requests").glob("*.ndjson"))[2]
        lines = victim.read_bytes().splitlines(keepends=True)
        bad = {"deep_nesting": b"[" * 100_000 + b"]" * 100_000 + b"\n",
               "huge_int": b'{"type":"step","step":' + b"9" * 5000 + b"}\n", "not_json": b"{\n"}[damage]
        victim.write_bytes(b"".join([*lines[:2], bad, *lines[2:]]))
        with pytest.raises(PackError, match=victim.name):
            pack_run(run, progress=False)
        again = collect(_cfg([server.url], docs_file, run))
    assert again.ok and again.completed == 1
    assert _journal(run) == clean_run[1]


@pytest.mark.timeout(60)
def test_pack_never_writes_over_a_run_or_a_foreign_folder(docs_file: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from collector.cli import pack as pack_cmd

    run = tmp_path / "self.zarr"   # a run directory that happens to look like a store name
    with FakeServer() as server:
        assert collect(_cfg([server.url], docs_file, run)).ok
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    folder = tmp_path / "precious.zarr"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    for out in (run, folder):
        for extra in ([], ["--overwrite"]):
            res = CliRunner().invoke(pack_cmd, [str(run), "-o", str(out), *extra])
            assert res.exit_code != 0 and str(out) in res.output, res.output
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert (folder / "notes.txt").read_text() == "mine" and len(list(folder.iterdir())) == 1
    res = CliRunner().invoke(pack_cmd, [str(run), "-o", str(tmp_path / "t.zarr")])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(pack_cmd, [str(run), "-o", str(tmp_path / "t.zarr"), "--overwrite"])
    assert res.exit_code == 0, res.output   # its own earlier output may be replaced


@pytest.mark.timeout(60)
def test_documents_cut_short_or_manifest_broken_are_refused(docs_file: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    with FakeServer() as server:
        assert collect(_cfg([server.url], docs_file, run)).ok
    copy = run / "documents.jsonl"
    whole = copy.read_bytes()
    copy.write_bytes(whole.splitlines(keepends=True)[0])
    with pytest.raises(PackError, match="documents.jsonl.*(sha256|n_docs)"):
        pack_run(run, progress=False)
    copy.write_bytes(whole)
    manifest = run / "manifest.json"
    text = manifest.read_text()
    manifest.write_text(text[: len(text) // 2])
    with pytest.raises(PackError, match="manifest.json.*not valid JSON"):
        pack_run(run, progress=False)
    with pytest.raises(CollectorError, match="manifest.json.*not valid JSON"):
        collect(_cfg(["http://127.0.0.1:9"], docs_file, run))
    data = json.loads(text)
    data["params"]["replicates"] = 3   # a manifest edited by hand: the journal disagrees
    manifest.write_text(json.dumps(data))
    with pytest.raises(PackError, match="replicates"):
        pack_run(run, progress=False)


MUST_SHOW_FAULTS = ("drop", "rewrite_policy", "drip", "gzip_garbage", "huge_int", "rewrite_temperature",
                    "deep_nesting", "rewrite_seed", "budget_overflow", "truncate", "rewrite_prompt", "not_utf8",
                    "header_reference", "bad_digest", "rewrite_doc", "422", "500")


@pytest.mark.timeout(240)
def test_two_servers_with_a_fault_every_fifth_request_give_the_fault_free_dataset(tmp_path: Path) -> None:
    docs = [D.Document(f"doc{i}", f"Document {i}.\n\nIts second paragraph, number {i}.") for i in range(40)]
    docs_file = D.write_jsonl(docs, tmp_path / "docs.jsonl")
    with FakeServer() as a, FakeServer() as b:
        assert collect(_cfg([a.url, b.url], docs_file, tmp_path / "clean")).ok
    with (FakeServer(fault_every=5, fault_cycle=MUST_SHOW_FAULTS) as a,
          FakeServer(fault_every=5, fault_cycle=MUST_SHOW_FAULTS[::-1]) as b):
        passes = []
        for _ in range(6):   # permanent failures finish the pass; the next resume retries them
            passes.append(collect(_cfg([a.url, b.url], docs_file, tmp_path / "faulty")))
            if passes[-1].ok:
                break
        faults = [r["fault"] for r in a.requests + b.requests if r["fault"] != "ok"]
    assert passes[-1].ok, passes[-1].summary()
    assert len(faults) >= len(docs) * 2 // 5
    print(f"{len(a.requests) + len(b.requests)} requests, {len(faults)} faults injected, {len(passes)} passes, "
          f"failed per pass {[len(p.failed) for p in passes]}, retries {[p.retries for p in passes]}")
    clean = pack_run(tmp_path / "clean", progress=False)
    faulty = pack_run(tmp_path / "faulty", progress=False)
    assert list(faulty.data_vars) == list(clean.data_vars)
    for name in clean.data_vars:  # bitwise: the same bytes, NaNs in the same places
        assert faulty[name].values.tobytes() == clean[name].values.tobytes(), name
    assert faulty.identical(clean)


@pytest.mark.timeout(60)
def test_a_journal_from_before_prompt_sha256_still_packs_and_resumes(docs_file: Path, tmp_path: Path,
                                                                     clean_run: tuple[Path, dict[str, bytes]]) -> None:
    from protocols import StreamWriter

    run = tmp_path / "run"
    with FakeServer() as server:
        assert collect(_cfg([server.url], docs_file, run)).ok
    for path in (run / "requests").glob("*.ndjson"):   # as an older server wrote them: no prompt digest
        records = [json.loads(line) for line in path.read_bytes().splitlines()]
        del records[0]["prompt_sha256"]
        w = StreamWriter()
        lines = [w.line(r) for r in records[:-1]]
        path.write_bytes(b"".join([*lines, w.end(records[-1]["steps"], records[-1]["replicates"], 0.0)]))
    old = pack_run(run, progress=False)
    assert old.sizes["doc"] == 3
    with FakeServer() as server:
        again = collect(_cfg([server.url], docs_file, run))
        assert again.ok and again.skipped == 6 and not server.requests
    clean = pack_run(clean_run[0], progress=False)
    for name in clean.data_vars:
        assert old[name].values.tobytes() == clean[name].values.tobytes(), name


@pytest.mark.timeout(60)
def test_a_designed_refusal_ends_its_policy_for_every_document_once(docs_file: Path, tmp_path: Path) -> None:
    """A 422 marked permanent (a press the server refuses on its model): asked once, never
    retried, not sent for the other documents; the summary names the policy once with its
    documents, and rerunning is not advised (nothing a rerun could collect)."""
    with FakeServer() as server:
        server.faults_for = {(f"doc{i}", "recent@0.5"): ["422_permanent"] * 6 for i in range(3)}
        result = collect(_cfg([server.url], docs_file, tmp_path / "run", max_attempts=6))
        asked = [r["doc_id"] for r in server.requests if r["candidate"] == "recent@0.5"]
    assert len(asked) == 1 and result.retries == 0
    assert result.completed == 3 and not result.failed and not result.retry_helps and not result.ok
    reason, documents = result.refused["recent@0.5"]
    assert sorted(documents) == ["doc0", "doc1", "doc2"] and "partial rotary" in reason
    assert result.summary().count("REFUSED") == 1 and "3 document(s)" in result.summary()
