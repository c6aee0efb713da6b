"""P's and Q's decoding forwards as one, chosen by measurement (``Engine.fuse``).

Fused and separate forwards give the same traces to rounding (same tokens), one
candidate or several; the measurement on the first step of a shape leaves no trace
in the results (a run that measures equals a run given the same choices); /info
reports the choice and the timings.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import copy
import math

import httpx
import pytest
from service_live import PROMPT, LiveServer

from gen_service.engine.facade import Engine
from gen_service.engine.jobs import CandidateDone, Sampling, TraceJob
from gen_service.models.loading import load_model

CANDIDATES = ["snapkv@0.5", "kvpress:AdaKVPress(SnapKVPress)@0.5", "recent@0.5"]


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny:llama")


def _run(engine: Engine, kind: str, **kw) -> list:
    job = TraceJob(prompt_ids=list(range(10, 110)), horizon=10, replicates=6, sampling=Sampling(), kind=kind,
                   request_id="r", **kw)
    return [i for i in engine.trace(job) if not isinstance(i, CandidateDone)]


def _engine(lm, fuse: str) -> Engine:
    engine = Engine(lm)
    engine.fuse = fuse
    return engine


def _assert_close(a: list, b: list, tol: float) -> None:
    assert len(a) == len(b)
    for ra, rb in zip(a, b, strict=True):
        assert ra.keys() == rb.keys()
        for key, va in ra.items():
            if ra.get("type") == "header" and key in ("fuse", "fused"):
                continue  # the header's numerics name the fusion mode, which is what differs
            if key == "tv" and tol:
                assert all((x is None and y is None) or math.isclose(x, y, abs_tol=tol)
                           for x, y in zip(va, rb[key], strict=True))
            else:
                assert va == rb[key], key


@pytest.mark.parametrize("kind", ["coupled", "residual"])
@pytest.mark.parametrize("many", [False, True])
def test_fused_equals_separate(lm, kind, many):
    kw = dict(candidate="", candidates=CANDIDATES, seeds=[1, 2, 3]) if many else dict(candidate="snapkv@0.5", seed=1)
    fused, calls = _engine(lm, "on"), []
    stacked = fused._forward_stacked
    fused._forward_stacked = lambda forwards: calls.append(len(forwards)) or stacked(forwards)
    a = _run(fused, kind, **kw)
    b = _run(_engine(lm, "off"), kind, **kw)
    _assert_close(a, b, tol=1e-5)
    assert {(r["fuse"], r["fused"]) for r in a if r.get("type") == "header"} == {("on", True)}
    assert {(r["fuse"], r["fused"]) for r in b if r.get("type") == "header"} == {("off", False)}
    # one forward per step over P's and Q's stackable sides: 2 alone, or P of 3 + Q of 2 (AdaKV's Q alone)
    assert calls and set(calls) <= ({2, 5} if many else {2})


@pytest.mark.parametrize("kind", ["coupled", "residual"])
def test_measuring_leaves_no_trace(lm, kind):
    auto = _engine(lm, "auto")
    kw = dict(candidate="", candidates=CANDIDATES, seeds=[1, 2, 3])
    a = _run(auto, kind, **kw)
    assert auto.fusion and all({"separate_ms", "fused_ms", "fused"} <= set(m) for m in auto.fusion_info()["measured"])
    pinned = _engine(lm, "auto")
    pinned.fusion = copy.deepcopy(auto.fusion)       # the same choices, nothing left to measure
    measures = []
    pinned._measure_fusion = lambda *args: measures.append(args)
    assert _run(pinned, kind, **kw) == a and not measures


def test_full_against_full_stays_exactly_zero_when_fused(lm):
    for kind in ("coupled", "residual"):
        recs = _run(_engine(lm, "on"), kind, candidate="full", seed=4)
        assert all(v in (0.0, None) for r in recs[1:] for v in r.get("tv", []))


@pytest.mark.service
def test_info_reports_the_choice() -> None:
    # no start-up self-check: its forwards would be the first measured (this test wants a request's)
    s = LiveServer(max_new_tokens=16, max_replicates=8, self_check=False)
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.get("/info").json()["kvdiv"]["fused_forward"] == {"mode": "auto", "measured": []}
            body = {"inputs": PROMPT, "candidate": "snapkv@0.5", "replicates": 2, "parameters": {"max_new_tokens": 3}}
            assert c.post("/v1/traces", json=body).status_code == 200
            measured = c.get("/info").json()["kvdiv"]["fused_forward"]["measured"]
            assert measured and measured[0]["forwards"] == 2 and isinstance(measured[0]["fused"], bool)
    finally:
        s.stop()
