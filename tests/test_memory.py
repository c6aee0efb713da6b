"""Requests sized by memory (gen_service/memory.py): the estimate against the caches a
request really builds, the gate's admit/refuse boundary, and the HTTP hook (422 with
the numbers, the budget in /info)."""

from __future__ import annotations

import pytest

from gen_service.coupling import Sampling
from gen_service.engine import Engine, TraceJob
from gen_service.memory import MemoryGate, ModelShape, RequestTooLarge, estimate, parse_budget
from gen_service.models import load_model
from gen_service.shared_cache import SharedPromptCache

SHAPE = ModelShape(layers=30, q_heads=9, kv_heads=3, head_dim=64, hidden=576, intermediate=1536, vocab=49152)


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny:llama")


def _bytes(cache) -> tuple[int, int]:
    """(prompt part, rows' part) of a cache after decoding."""
    if isinstance(cache, SharedPromptCache):
        return cache.prompt_bytes(), cache.row_bytes()
    total = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    return total, 0


@pytest.mark.parametrize("shared", [True, False])
def test_kv_estimate_bounds_the_caches_a_request_builds(lm, shared):
    engine = Engine(lm, shared_prompt=shared)
    R, T, ids = 5, 7, list(range(10, 90))
    sides = []
    # keep the sides the coupled loop decodes with, to weigh them afterwards
    orig = engine._coupled

    def spy(job, p0, q0, gen, cancelled):
        sides.extend([p0.side, q0.side])
        yield from orig(job, p0, q0, gen, cancelled)

    engine._coupled = spy
    job = TraceJob(prompt_ids=ids, candidate="full", horizon=T, replicates=R, seed=0, sampling=Sampling())
    list(engine.trace(job))
    est = estimate(ModelShape.of(lm.model.config, lm.dtype.itemsize), R, len(ids), T, shared_prompt=shared)
    prompt, rows = map(sum, zip(*(_bytes(s.cache) for s in sides), strict=True))
    if shared:   # exact: the prompt once per side, T slots per row per side
        assert prompt == est.prompt_kv and rows == est.row_kv
    else:        # R copies of prompt + T − 1 decoded slots, within the bound
        assert prompt <= est.prompt_kv + est.row_kv
        assert prompt >= est.prompt_kv


def test_estimate_scales_as_designed():
    one, many = estimate(SHAPE, 1, 783, 32), estimate(SHAPE, 64, 783, 32)
    assert one.prompt_kv == many.prompt_kv                    # shared: the prompt does not grow with R
    assert many.row_kv == 64 * one.row_kv
    assert many.per_row == 2 * 32 * SHAPE.kv_bytes_per_token  # the row's own tokens, both sides
    copies = estimate(SHAPE, 64, 783, 32, shared_prompt=False)
    assert copies.prompt_kv == 64 * many.prompt_kv
    res = estimate(SHAPE, 64, 783, 32, kind="residual")
    assert res.row_kv == 2 * many.row_kv and res.prompt_kv == 2 * many.prompt_kv
    with pytest.raises(ValueError, match="kind"):
        estimate(SHAPE, 1, 10, 10, kind="greedy")
    with pytest.raises(ValueError, match=">= 1"):
        estimate(SHAPE, 0, 10, 10)


def test_gate_admits_up_to_the_budget_and_names_the_numbers():
    budget = estimate(SHAPE, 100, 783, 32).total
    gate = MemoryGate(SHAPE, budget)
    assert gate.admit(100, 783, 32).total == budget
    assert gate.max_rows(783, 32) == 100
    with pytest.raises(RequestTooLarge) as err:
        gate.admit(101, 783, 32)
    msg = str(err.value)
    assert "R=101" in msg and "MiB" in msg and "at most R=100 fits" in msg
    tiny = MemoryGate(SHAPE, 1000)
    with pytest.raises(RequestTooLarge, match="no R fits"):
        tiny.admit(1, 783, 32)
    big = MemoryGate(SHAPE, 64 << 30)
    assert big.max_rows(783, 32) >= 1024          # R = 1024 where memory allows


def test_gate_for_engine_measures_free_memory(lm):
    gate = MemoryGate.for_engine(Engine(lm), 0.5)
    assert 0 < gate.budget
    assert MemoryGate.for_engine(Engine(lm), 123456789).budget == 123456789
    assert gate.info()["memory_budget"] == gate.budget


def test_parse_budget():
    assert parse_budget("2GiB") == 2 * (1 << 30)
    assert parse_budget(" 0.25 ") == 0.25
    assert parse_budget("") is None
    for bad in ("lots", "-1", "0"):
        with pytest.raises(ValueError, match="memory budget"):
            parse_budget(bad)


def test_http_refuses_a_request_that_can_never_fit():
    from starlette.testclient import TestClient

    from gen_service.server_cli import build_service

    app, service = build_service("tiny:llama", memory_budget=4 << 20)
    with TestClient(app) as client:
        info = client.get("/info").json()["kvdiv"]
        assert info["memory_budget"] == 4 << 20 and info["max_replicates"] == 1024
        body = {"inputs": "hello there", "candidate": "snapkv@0.5", "replicates": 1000,
                "parameters": {"max_new_tokens": 8}}
        r = client.post("/v1/traces", json=body)
        assert r.status_code == 422
        assert "replicates" in r.json()["error"] and "at most R=" in r.json()["error"]
        body["replicates"] = 2
        r = client.post("/v1/traces", json=body)
        assert r.status_code == 200 and r.text.count('"type": "step"') + r.text.count('"type":"step"') == 8
