"""Requests sized by memory (gen_service/serving/memory.py, admission.py): the estimate against the caches a
request really builds, the gate's admit/refuse boundary, and the HTTP hook (422 with
the numbers, the budget in /info)."""

from __future__ import annotations

import pytest

from gen_service.attention.shared_cache import SharedPromptCache, pooled_length
from gen_service.engine.facade import Engine
from gen_service.engine.jobs import Sampling, TraceJob
from gen_service.errors import RequestTooLarge
from gen_service.models.loading import load_model
from gen_service.serving.admission import MemoryGate, ModelShape, estimate, parse_budget

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
    orig = engine._decode

    def spy(job, p0, q0, seed, cancelled):
        sides.extend([p0.side, q0.side])
        return orig(job, p0, q0, seed, cancelled)

    engine._decode = spy
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

    from gen_service.api.cli import build_service

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


# ---------------------------------------------------------------------- per-row sides

DECODING = "kvpress:DecodingPress(KnormPress):compression_interval=2,target_size=64"
DMS = "kvpress:DMSPress(KnormPress):threshold=-9.0,sliding_window_size=16,decoding=true"
QUANT = "quant:kivi@4:residual_length=2,group_size=7"   # flushes every other step


def _kv_bytes_per_token(lm) -> int:
    """Keys + values of one token, one side, from the config (independently of ModelShape)."""
    c = lm.model.config
    return c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) \
        * lm.dtype.itemsize * 2


def _describe(gate, engine, policy, prompt_len, kind):
    from gen_service.presses.registry import ModelInfo

    info = ModelInfo.of(engine.lm)
    plan = engine.registry.build(policy, info).plan(prompt_len)
    return gate.describe(policy, engine.registry.build("full", info).plan(prompt_len), plan, kind)


@pytest.mark.parametrize("policy", [DECODING, DMS, QUANT, "snapkv@0.5+quant:kivi@2"])
def test_per_row_candidate_counts_its_copies(lm, policy):
    engine = Engine(lm)
    gate = MemoryGate.for_engine(engine, 1 << 40)
    R, L, T = 16, 100, 8
    token = _kv_bytes_per_token(lm)
    for kind, extra in (("coupled", R - 1), ("residual", 2 * R - 1)):
        side = _describe(gate, engine, policy, L, kind)
        assert side.p.shared and not side.q.shared and side.per_row_sides == "Q"
        assert side.replayed == (kind == "residual")
        old, new = gate.estimate(R, L, T, kind), gate.estimate(R, L, T, kind, sides=[side])
        # Q's prompt: R copies (coupled) or R survival + 1 snapshot + R replayed branch rows
        # (residual) instead of one shared copy (+ 1 snapshot), and no slot in the stacked
        # forwards' pool (a shared side's, padded up to the CPU key block)
        pad = pooled_length(L, lm.device) - L
        assert new.prompt_kv - old.prompt_kv == (extra * L - pad) * token
        assert new.row_kv == old.row_kv
        assert new.activations >= old.activations and new.total > old.total


@pytest.mark.parametrize("kind", ["coupled", "residual"])
@pytest.mark.parametrize("policy", ["full", "snapkv@0.5", "adakv@0.5", "pyramidkv@0.5"])
def test_shared_candidate_estimate_is_unchanged(lm, policy, kind):
    engine = Engine(lm)
    gate = MemoryGate.for_engine(engine, 1 << 40)
    side = _describe(gate, engine, policy, 100, kind)
    assert side.per_row_sides == "" and not side.replayed
    assert gate.estimate(16, 100, 8, kind, sides=[side]) == gate.estimate(16, 100, 8, kind)
    assert gate.estimate(16, 100, 8, kind, sides=[side] * 3) == gate.estimate(16, 100, 8, kind, candidates=3)


def _peak_bytes(run) -> int:
    """Peak of the bytes torch allocates on the CPU while ``run()`` runs, from the
    profiler's allocation and free events in time order (relative to the start)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    assert events, "the profiler recorded no allocation"
    now = peak = 0
    for e in events:
        now += e.nbytes()
        peak = max(peak, now)
    return peak


@pytest.mark.parametrize(("policy", "kind"), [(DECODING, "coupled"), (DMS, "residual"), (QUANT, "coupled")])
def test_estimate_bounds_the_measured_peak_of_a_per_row_request(lm, policy, kind):
    engine = Engine(lm)
    gate = MemoryGate.for_engine(engine, 1 << 40)
    R, T, ids = 64, 12, [10 + i % 300 for i in range(400)]
    job = TraceJob(prompt_ids=ids, candidate=policy, kind=kind, horizon=T, replicates=R, seed=0)
    peak = _peak_bytes(lambda: list(engine.trace(job)))
    est = gate.estimate(R, len(ids), T, kind, sides=[_describe(gate, engine, policy, len(ids), kind)])
    assert peak <= est.total, f"measured {peak} B > estimate {est.describe()}"
    # the estimate that assumed a shared prompt did not bound it
    assert peak > gate.estimate(R, len(ids), T, kind).total


def test_http_refuses_a_per_row_candidate_the_old_estimate_admitted():
    from starlette.testclient import TestClient

    from gen_service.api.cli import build_service

    R, T, text = 8, 8, "hello there, " * 20
    app, service = build_service("tiny:llama", memory_budget=1 << 30)
    L = len(service.encode(text))
    # a budget the old estimate (every prompt shared) admits exactly, one and two candidates
    service.memory.budget = service.memory.estimate(R, L, T, "residual", candidates=2).total
    body = {"inputs": text, "replicates": R, "kind": "residual", "parameters": {"max_new_tokens": T}}
    with TestClient(app) as client:
        r = client.post("/v1/traces", json={**body, "candidates": ["snapkv@0.5", "adakv@0.5"]})
        assert r.status_code == 200 and '"type":"end"' in r.text.replace(" ", "")
        r = client.post("/v1/traces", json={**body, "candidates": ["snapkv@0.5", QUANT]})
        assert r.status_code == 422
        msg = r.json()["error"]
        assert f"candidates[1] ({QUANT}) keeps per-row copies of the prompt on its Q side" in msg
        assert "candidates[0]" not in msg and "at most R=" in msg
        service.memory.budget = service.memory.estimate(R, L, T, "coupled").total
        r = client.post("/v1/traces", json={**body, "kind": "coupled", "candidate": DECODING})
        assert r.status_code == 422
        assert f"candidate ({DECODING}) keeps per-row copies" in r.json()["error"]


# ------------------------------------------------- eager prefill, prompt log-probabilities

def _wide_vocab_model(path) -> str:
    """A 2-layer model with an 8192-token untied head, saved where load_model reads it:
    its (L, V) logits dominate a prompt_logprobs request."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from gen_service.models.loading import byte_tokenizer

    config = LlamaConfig(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_estimate_bounds_the_measured_peak_of_an_eager_prefill(dtype):
    """h2o (ObservedAttention) prefills under eager attention: one layer's L x L float32
    scores at once, which the old estimate (a tiled block) left out."""
    engine = Engine(load_model("tiny:llama", dtype=dtype))
    gate = MemoryGate.for_engine(engine, 1 << 40)
    R, T, ids = 4, 4, [10 + i % 300 for i in range(1024)]
    job = TraceJob(prompt_ids=ids, candidate="h2o@0.5", horizon=T, replicates=R, seed=0)
    peak = _peak_bytes(lambda: list(engine.trace(job)))
    side = _describe(gate, engine, "h2o@0.5", len(ids), "coupled")
    assert side.q.eager and not side.p.eager
    est = gate.estimate(R, len(ids), T, sides=[side])
    assert peak <= est.total, f"measured {peak} B > estimate {est.describe()}"
    assert peak > gate.estimate(R, len(ids), T).total     # SDPA's tiled block did not bound it


def test_eager_and_prompt_logprobs_terms_scale_as_l2_and_lv():
    from gen_service.serving.admission import eager_attention_bytes, prompt_logprobs_bytes

    big = ModelShape(layers=32, q_heads=32, kv_heads=8, head_dim=128, hidden=4096, intermediate=14336,
                     vocab=128256, dtype_bytes=2)
    for L in (2048, 4096):
        assert eager_attention_bytes(big, 2 * L) == 4 * eager_attention_bytes(big, L)
        assert prompt_logprobs_bytes(big, 2 * L) == 2 * prompt_logprobs_bytes(big, L)
    assert eager_attention_bytes(big, 4096) >= 32 * 4096 ** 2 * 4                 # the float32 softmax
    assert prompt_logprobs_bytes(big, 4096) >= 2 * 4096 * 128256 * 4              # logits + log-softmax


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_estimate_bounds_the_measured_peak_of_prompt_logprobs(tmp_path, dtype):
    from gen_service.serving.admission import estimate_generate, prompt_logprobs_bytes

    engine = Engine(load_model(_wide_vocab_model(tmp_path), device="cpu", dtype=dtype))
    gate = MemoryGate.for_engine(engine, 1 << 40)
    peaks = {}
    for L in (256, 512):
        ids = [10 + i % 200 for i in range(L)]
        peaks[L] = _peak_bytes(lambda ids=ids: engine.prompt_logprobs(ids))
        assert peaks[L] <= prompt_logprobs_bytes(gate.shape, L) <= estimate_generate(
            gate.shape, L, 1, prompt_logprobs=True).total
        assert peaks[L] >= 2 * L * gate.shape.vocab * 4                    # the term is really there
    assert 1.9 < peaks[512] / peaks[256] < 2.1                             # linear in L


def test_http_refuses_prompt_logprobs_and_eager_prefill_that_never_fit(tmp_path):
    from starlette.testclient import TestClient

    from gen_service.api.cli import build_service
    from gen_service.serving.admission import estimate_generate

    app, service = build_service(_wide_vocab_model(tmp_path), memory_budget=1 << 30)
    text = "hello there, " * 25
    L = len(service.encode(text))
    shape = service.memory.shape
    service.memory.budget = estimate_generate(shape, L, 4).total
    assert estimate_generate(shape, L, 4, prompt_logprobs=True).total > service.memory.budget
    body = {"inputs": text, "parameters": {"max_new_tokens": 4, "details": True}}
    with TestClient(app) as client:
        assert client.post("/generate", json=body).status_code == 200
        body["parameters"]["decoder_input_details"] = True
        r = client.post("/generate", json=body)
        assert r.status_code == 422
        msg = r.json()["error"]
        assert "decoder_input_details" in msg and "log-probabilities" in msg and f"{shape.vocab} float32" in msg
        # a trace whose candidate prefills under eager attention, refused naming it
        # a trace whose candidate prefills under eager attention, at a budget the estimate
        # without eager attention admits: refused, naming it
        long = text * 4
        gate, L = service.memory, len(service.encode(long))
        gate.budget = gate.estimate(2, L, 4).total
        trace = {"inputs": long, "replicates": 2, "parameters": {"max_new_tokens": 4}}
        assert client.post("/v1/traces", json={**trace, "candidate": "snapkv@0.5"}).status_code == 200
        r = client.post("/v1/traces", json={**trace, "candidate": "h2o@0.5"})
        assert r.status_code == 422
        assert "h2o@0.5 prefills under eager attention" in r.json()["error"]
