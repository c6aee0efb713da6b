"""Several candidates in one ``/v1/traces`` request (gen_service/engine/scheduler.py, handlers.py).

One multi-candidate request must give each candidate the traces of its own request with
the same seed: bit for bit when every forward runs alone (``batch_candidates = False``),
to floating-point rounding (same tokens) when the shared-prompt sides' forwards are
stacked. Candidates cover every path: prefill-only (stacked), a decoding-time press
(per-row copies: alone), head-wise masks (alone on Q, stacked on P), per-layer budgets
and quantized caches (alone, with and without a press).
"""

from __future__ import annotations

import os

# Before torch loads OpenMP: busy-waiting threads collapse on shared cores (see docs/service.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import json
import math
from collections.abc import Iterator

import httpx
import pytest
from service_live import PROMPT, LiveServer

from gen_service.engine.facade import Engine
from gen_service.engine.jobs import CandidateDone, CandidateFailed, Sampling, TraceJob
from gen_service.models.loading import load_model
from protocols import assemble, read_stream
from protocols.stream import StreamError

DECODING = "kvpress:DecodingPress(KnormPress):compression_interval=4,target_size=64"
ADAKV = "kvpress:AdaKVPress(SnapKVPress)@0.5"
QUANT = "snapkv@0.5+quant:kivi@4"
CANDIDATES = ["snapkv@0.5", DECODING, ADAKV, "recent@0.5", "kvpress:PyramidKVPress@0.5", QUANT, "quant:kivi@2"]
SEEDS = [11, 12, 13, 14, 15, 16, 17]


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny:llama")


def _job(kind: str, **kw) -> dict:
    return dict(prompt_ids=list(range(10, 110)), horizon=10, replicates=6, sampling=Sampling(), kind=kind,
                request_id="r", **kw)


def _split(items: list) -> tuple[dict[str, list[dict]], list]:
    """Per-candidate records (the ``candidate`` tag removed) and the end markers, in order."""
    out: dict[str, list[dict]] = {}
    markers = []
    for item in items:
        if isinstance(item, (CandidateDone, CandidateFailed)):
            markers.append(item)
            continue
        rec = dict(item)
        policy = rec["candidate"]["policy"] if rec["type"] == "header" else rec.pop("candidate")
        out.setdefault(policy, []).append(rec)
    return out, markers


def _assert_same(a: list[dict], b: list[dict], tol: float) -> None:
    assert len(a) == len(b)
    mode = ("fuse", "fused")                 # the header's fusion mode: "auto" here, "off" there
    assert {k: v for k, v in a[0].items() if k not in mode} == {k: v for k, v in b[0].items() if k not in mode}
    for ra, rb in zip(a[1:], b[1:], strict=True):
        assert ra.keys() == rb.keys()
        for key, va in ra.items():
            if key == "tv" and tol:
                assert all((x is None and y is None) or math.isclose(x, y, abs_tol=tol)
                           for x, y in zip(va, rb[key], strict=True))
            else:
                assert va == rb[key], key


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("kind", ["coupled", "residual"])
def test_one_request_equals_one_request_per_candidate(lm, kind, batched):
    engine = Engine(lm)
    engine.batch_candidates = batched
    items = list(engine.trace(TraceJob(candidate="", candidates=CANDIDATES, seeds=SEEDS, **_job(kind))))
    # every header first (only once every prefill ran), then the records
    assert [type(i) for i in items[:len(CANDIDATES)]] == [dict] * len(CANDIDATES)
    assert all(i["type"] == "header" for i in items[:len(CANDIDATES)])
    split, markers = _split(items)
    assert all(isinstance(m, CandidateDone) for m in markers)
    assert sorted(m.policy for m in markers) == sorted(CANDIDATES)
    separate = Engine(lm)
    separate.fuse = "off"   # each forward alone, as the unbatched multi-candidate request runs them
    for policy, seed in zip(CANDIDATES, SEEDS, strict=True):
        alone = list(separate.trace(TraceJob(candidate=policy, seed=seed, **_job(kind))))
        _assert_same(split[policy], alone, tol=1e-5 if batched else 0.0)


def test_stacking_runs_fewer_forwards(lm, monkeypatch):
    """P rows of every candidate run in one forward, and Q rows of the stackable ones."""
    engine = Engine(lm)
    engine.fuse = "off"   # P's and Q's stacks apart (fused: one forward, tests/test_service_fusion.py)
    calls = {"stacked": 0, "alone": 0}
    stacked, alone = engine._forward_stacked, engine._run_forward

    def count_stacked(forwards):
        calls["stacked"] += 1
        return stacked(forwards)

    def count_alone(f):
        calls["alone"] += 1
        return alone(f)

    monkeypatch.setattr(engine, "_forward_stacked", count_stacked)
    monkeypatch.setattr(engine, "_run_forward", count_alone)
    pols = ["snapkv@0.5", "recent@0.5", ADAKV]
    list(engine.trace(TraceJob(candidate="", candidates=pols, seeds=[1, 2, 3], **_job("coupled"))))
    steps = 9   # T - 1 decoding forwards per side
    assert calls == {"stacked": 2 * steps, "alone": steps}   # P: 1, Q: snapkv + recent stacked, AdaKV alone


def test_a_failing_candidate_leaves_the_others_complete(lm, monkeypatch):
    engine = Engine(lm)
    decode = engine._decode

    def flaky(job, p0, q0, seed, cancelled):
        loop = decode(job, p0, q0, seed, cancelled)
        if job.candidate != "recent@0.5":
            return loop

        def broken():
            answer = None
            for _ in range(4):
                item = loop.send(answer)
                answer = yield item
            raise RuntimeError("boom")
        return broken()

    monkeypatch.setattr(engine, "_decode", flaky)
    pols = ["snapkv@0.5", "recent@0.5", "streaming@0.5"]
    items = list(engine.trace(TraceJob(candidate="", candidates=pols, seeds=[1, 2, 3], **_job("coupled"))))
    split, markers = _split(items)
    failed = [m for m in markers if isinstance(m, CandidateFailed)]
    assert [m.policy for m in failed] == ["recent@0.5"] and "boom" in str(failed[0].error)
    for policy, seed in (("snapkv@0.5", 1), ("streaming@0.5", 3)):
        alone = list(Engine(lm).trace(TraceJob(candidate=policy, seed=seed, **_job("coupled"))))
        _assert_same(split[policy], alone, tol=1e-5)


# ---------------------------------------------------------------------- over HTTP

@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    s = LiveServer(max_new_tokens=64, max_replicates=16)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _lines(client: httpx.Client, body: dict) -> list[bytes]:
    r = client.post("/v1/traces", json=body)
    assert r.status_code == 200, r.text
    return [line + b"\n" for line in r.content.split(b"\n") if line]


def _by_candidate(lines: list[bytes]) -> dict[str, list[bytes]]:
    out: dict[str, list[bytes]] = {}
    for line in lines:
        rec = json.loads(line)
        policy = rec["candidate"]["policy"] if rec["type"] == "header" else rec["candidate"]
        out.setdefault(policy, []).append(line)
    return out


@pytest.mark.service
@pytest.mark.parametrize("kind", ["coupled", "residual"])
def test_http_streams_split_into_valid_per_candidate_streams(client, kind):
    info = client.get("/info").json()["kvdiv"]
    assert info["trace_candidates"] is True and info["max_candidates"] >= 4
    pols = ["snapkv@0.5", DECODING, ADAKV]
    base = {"inputs": PROMPT, "kind": kind, "replicates": 3, "doc_id": "d", "parameters": {"max_new_tokens": 6}}
    multi = _by_candidate(_lines(client, {**base, "candidates": pols, "seeds": [5, 6, 7]}))
    assert sorted(multi) == sorted(pols)
    for policy, seed in zip(pols, [5, 6, 7], strict=True):
        stream = read_stream(multi[policy])           # its own digest, order and shapes
        assert stream.end["candidate"] == policy and stream.header["seed"] == seed
        assert all(rec["candidate"] == policy for rec in stream.records)
        ds = assemble(multi[policy])
        alone = assemble(_lines(client, {**base, "candidate": policy, "parameters": {"max_new_tokens": 6,
                                                                                      "seed": seed}}))
        for var in ds.data_vars:
            if var.endswith("token") or var == "branch_step":
                assert (ds[var].values == alone[var].values).all(), (policy, var)
            elif var.endswith("tv"):
                assert float(abs(ds[var].fillna(0) - alone[var].fillna(0)).max()) < 1e-5, (policy, var)


@pytest.mark.service
def test_a_line_of_another_candidate_is_refused(client):
    body = {"inputs": PROMPT, "replicates": 2, "candidates": ["snapkv@0.5", "recent@0.5"],
            "parameters": {"max_new_tokens": 3}}
    split = _by_candidate(_lines(client, body))
    mixed = [split["snapkv@0.5"][0], split["recent@0.5"][1], *split["snapkv@0.5"][1:]]
    with pytest.raises(StreamError, match="record of candidate 'recent@0.5' in the stream of 'snapkv@0.5'"):
        read_stream(mixed)


@pytest.mark.service
def test_http_one_seed_for_every_candidate(client):
    body = {"inputs": PROMPT, "replicates": 2, "candidates": ["snapkv@0.5", "recent@0.5"],
            "parameters": {"max_new_tokens": 3, "seed": 42}}
    seeds = {p: read_stream(lines).header["seed"] for p, lines in _by_candidate(_lines(client, body)).items()}
    assert seeds == {"snapkv@0.5": 42, "recent@0.5": 42}


@pytest.mark.service
@pytest.mark.parametrize("extra, field", [
    ({"candidates": []}, "candidates"),
    ({"candidates": "snapkv@0.5"}, "candidates"),
    ({"candidates": ["snapkv@0.5", "snapkv@0.5"]}, "candidates[1]: duplicate"),
    ({"candidates": ["snapkv@0.5", "bogus@0.5"]}, "candidates[1]"),
    ({"candidates": ["snapkv@0.5", ""]}, "candidates[1]"),
    ({"candidates": ["snapkv@0.5"], "candidate": "snapkv@0.5"}, "candidates"),
    ({"candidates": ["snapkv@0.5", "recent@0.5"], "seeds": [1]}, "seeds"),
    ({"candidates": ["snapkv@0.5"], "seeds": [-1]}, "seeds[0]"),
    ({"candidates": ["snapkv@0.5"], "seeds": [1], "seed": 2}, "seeds"),
    ({"candidate": "snapkv@0.5", "seeds": [1]}, "seeds"),
])
def test_http_bad_candidates_422(client, extra, field):
    r = client.post("/v1/traces", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}, **extra})
    assert r.status_code == 422 and r.json()["error_type"] == "validation", r.text
    assert r.json()["error"].startswith(field), r.json()["error"]


@pytest.mark.service
def test_http_memory_counts_every_candidate(client, server):
    gate = server.service.memory
    ids = server.service.encode(PROMPT)
    one, four = (gate.estimate(8, len(ids), 6, "coupled", c).total for c in (1, 4))
    assert four > one
    before = gate.budget
    gate.budget = (one + four) // 2      # one candidate fits, four do not
    try:
        body = {"inputs": PROMPT, "replicates": 8, "parameters": {"max_new_tokens": 6}}
        assert client.post("/v1/traces", json={**body, "candidate": "snapkv@0.5"}).status_code == 200
        pols = ["snapkv@0.5", "recent@0.5", "streaming@0.5", "knorm@0.5"]
        r = client.post("/v1/traces", json={**body, "candidates": pols})
        assert r.status_code == 422 and r.json()["error"].startswith("replicates: ")
        assert "for each of 4 candidates" in r.json()["error"]
    finally:
        gate.budget = before
