"""The HTTP service on a live loopback uvicorn (tiny model): TGI clients, traces, 422s."""

from __future__ import annotations

import os

# Before torch loads OpenMP: busy-waiting threads collapse on shared cores (see docs/service.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import json
import time
from collections.abc import Iterator

import httpx
import pytest
from service_live import PROMPT, LiveServer

from protocols import assemble

pytestmark = pytest.mark.service


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    s = LiveServer(max_new_tokens=64, max_replicates=16, eviction="snapkv@0.5")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def test_health_info_policies_metrics(client: httpx.Client) -> None:
    assert client.get("/health").json()["status"] == "ok"
    info = client.get("/info").json()
    assert info["model_id"] == "tiny:llama" and info["max_total_tokens"] == 2048
    # which path each attention feature takes (gen_service.attention.plan): plain attention here
    assert info["kvdiv"]["attention"]["layer_types"] == {"full": [0, 1]}
    assert info["kvdiv"]["attention"]["windows"] == []
    assert "snapkv#512" in client.get("/v1/policies").json()["examples"]
    assert "kvdiv_requests_total" in client.get("/metrics").text


def test_tokenize(client: httpx.Client) -> None:
    toks = client.post("/tokenize", json={"inputs": "ab c"}).json()
    assert [t["text"] for t in toks] == ["a", "b", " ", "c"] and toks[3]["start"] == 3


def test_generate_shapes_and_seed(client: httpx.Client) -> None:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 6, "details": True, "do_sample": True,
                                             "seed": 4, "top_n_tokens": 2, "decoder_input_details": True}}
    a = client.post("/generate", json=body).json()
    b = client.post("/generate", json=body).json()
    assert a == b
    det = a["details"]
    assert det["generated_tokens"] == len(det["tokens"]) and det["seed"] == 4
    assert all(t["logprob"] <= 0 for t in det["tokens"]) and len(det["top_tokens"][0]) == 2
    assert det["prefill"][0]["logprob"] is None and len(det["prefill"]) > 10
    assert det["finish_reason"] in ("length", "eos_token")


def test_official_text_generation_client(server: LiveServer) -> None:
    from text_generation import Client

    c = Client(server.url, timeout=30)
    resp = c.generate(PROMPT, max_new_tokens=5, seed=1, do_sample=True)
    assert resp.details.generated_tokens == 5 and len(resp.details.tokens) == 5
    assert all(t.logprob is not None for t in resp.details.tokens)
    chunks = list(c.generate_stream(PROMPT, max_new_tokens=4, seed=1, do_sample=True))
    assert len(chunks) == 4 and chunks[-1].details.generated_tokens == 4
    assert [ch.token.id for ch in chunks] == [t.id for t in c.generate(PROMPT, max_new_tokens=4, seed=1,
                                                                         do_sample=True).details.tokens]


def test_huggingface_hub_inference_client(server: LiveServer) -> None:
    from huggingface_hub import InferenceClient

    hub = InferenceClient(base_url=server.url, timeout=30)
    out = hub.text_generation(PROMPT, max_new_tokens=5, details=True, seed=2, do_sample=True)
    assert out.details.generated_tokens == 5 and all(t.logprob <= 0 for t in out.details.tokens)
    streamed = list(hub.text_generation(PROMPT, max_new_tokens=3, stream=True, details=True))
    assert len(streamed) == 3
    assert isinstance(hub.text_generation(PROMPT, max_new_tokens=2), str)


def test_generate_stream_sse(client: httpx.Client) -> None:
    with client.stream("POST", "/generate_stream", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}}) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert len(events) == 3 and events[-1]["details"]["finish_reason"] == "length"
    assert events[-1]["generated_text"] is not None and events[0]["generated_text"] is None


def _trace(client: httpx.Client, body: dict, sse: bool = False) -> list[str]:
    headers = {"accept": "text/event-stream"} if sse else {}
    with client.stream("POST", "/v1/traces", json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        lines = list(r.iter_lines())
    if sse:
        return [line[6:] for line in lines if line.startswith("data: ")]
    return [line for line in lines if line]


def test_traces_ndjson_and_sse_assemble(client: httpx.Client) -> None:
    body = {"inputs": PROMPT, "candidate": "snapkv@0.5", "kind": "residual", "replicates": 4, "window": 3,
            "doc_id": "doc-1", "parameters": {"max_new_tokens": 6, "seed": 9}}
    nd = _trace(client, body)
    ds = assemble(nd)
    assert ds.attrs["kind"] == "residual" and list(ds["doc"].values) == ["doc-1"]
    sse = _trace(client, body, sse=True)
    strip = [json.loads(x) for x in sse]
    assert [{k: v for k, v in r.items() if k not in ("request_id", "elapsed_s", "sha256")} for r in strip] == \
        [{k: v for k, v in json.loads(x).items() if k not in ("request_id", "elapsed_s", "sha256")} for x in nd]
    assemble(sse)
    coupled = _trace(client, {"messages": [{"role": "user", "content": "Summarise: " + PROMPT}],
                              "candidate": "streaming@0.5", "replicates": 2, "parameters": {"max_new_tokens": 4}})
    assert assemble(coupled).attrs["kind"] == "coupled"


@pytest.mark.parametrize("body, field", [
    ({"inputs": "", "candidate": "snapkv@0.5"}, "inputs"),
    ({"inputs": PROMPT * 40, "candidate": "snapkv@0.5"}, "inputs"),
    ({"inputs": PROMPT, "candidate": "bogus@0.5"}, "candidate"),
    ({"inputs": PROMPT, "candidate": "snapkv@1.5"}, "candidate"),
    ({"inputs": PROMPT, "candidate": "snapkv@0"}, "candidate"),
    ({"inputs": PROMPT, "candidate": "snapkv#0"}, "candidate"),
    ({"inputs": PROMPT, "candidate": "snapkv@0.5", "parameters": {"max_new_tokens": 65}}, "max_new_tokens"),
    ({"inputs": PROMPT, "candidate": "snapkv@0.5", "replicates": 17}, "replicates"),
    ({"inputs": PROMPT, "candidate": "snapkv@0.5", "kind": "residual", "window": 9,
      "parameters": {"max_new_tokens": 8}}, "window"),
    ({"inputs": PROMPT, "candidate": "snapkv@0.5", "parameters": {"temperature": -1}}, "temperature"),
    ({"inputs": PROMPT, "candidate": "snapkv@0.5", "kind": "crude"}, "kind"),
    ({"inputs": PROMPT}, "candidate"),
])
def test_traces_bad_input_422(client: httpx.Client, body: dict, field: str) -> None:
    r = client.post("/v1/traces", json=body)
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
    assert field in r.json()["error"]


def test_malformed_and_oversized_bodies_422(client: httpx.Client, server: LiveServer) -> None:
    r = client.post("/v1/traces", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and "malformed JSON" in r.json()["error"]
    big = b'{"inputs": "' + b"a" * (server.service.config.max_body_bytes + 1) + b'"}'
    assert client.post("/generate", content=big).status_code == 422
    assert client.post("/generate", json={"inputs": PROMPT, "parameters": {"eviction": "nope"}}).status_code == 422
    assert client.post("/generate", json={"inputs": PROMPT, "parameters": {"watermark": True}}).status_code == 422
    assert client.get("/health").status_code == 200  # and the server keeps serving


def test_auth_queue_limit_and_disconnect_cancels() -> None:
    s = LiveServer(api_key="sekret", max_queue=1, max_new_tokens=2000, max_replicates=64)
    try:
        with httpx.Client(base_url=s.url, timeout=30) as c:
            assert c.get("/health").status_code == 200
            assert c.get("/info").status_code == 401
            assert c.get("/info", headers={"authorization": "Bearer sekreT"}).status_code == 401
            auth = {"authorization": "Bearer sekret"}
            assert c.get("/info", headers=auth).status_code == 200
            long = {"inputs": PROMPT, "candidate": "snapkv@0.5", "replicates": 64,
                    "parameters": {"max_new_tokens": 1500}}
            with c.stream("POST", "/v1/traces", json=long, headers=auth) as r:
                lines = r.iter_lines()
                next(lines)
                next(lines)  # the first step is out: the request holds the only slot
                busy = c.post("/v1/traces", json={**long, "parameters": {"max_new_tokens": 2}}, headers=auth)
                assert busy.status_code == 429 and busy.json()["error_type"] == "overloaded"
                assert busy.headers["retry-after"] == "1"
                t0 = time.perf_counter()
                assert c.get("/health").status_code == 200
                assert time.perf_counter() - t0 < 1.0  # model work is off the event loop
            for _ in range(100):  # the disconnect frees the slot within a step or two
                if s.service.admission.count == 0:
                    break
                time.sleep(0.05)
            assert s.service.admission.count == 0
            assert s.service.metrics.cancelled._value.get() >= 1
            ok = c.post("/v1/traces", json={**long, "parameters": {"max_new_tokens": 2}}, headers=auth)
            assert ok.status_code == 200 and assemble(ok.text).sizes["step"] == 2
    finally:
        s.stop()


class BoomPress:
    """A custom press (registered with --press) that fails during prefill."""

    def __init__(self, compression_ratio: float = 0.0):
        self.compression_ratio = compression_ratio

    def __call__(self, model):
        raise RuntimeError("boom")


def test_press_failing_in_prefill_is_a_422_before_streaming() -> None:
    s = LiveServer(press=("boom=test_service_http:BoomPress",))
    try:
        with httpx.Client(base_url=s.url, timeout=30) as c:
            small = {"max_new_tokens": 3}
            r = c.post("/v1/traces", json={"inputs": PROMPT, "candidate": "boom@0.5", "parameters": small})
            assert r.status_code == 422 and r.json()["error"].startswith("candidate:") and "boom" in r.json()["error"]
            g = c.post("/generate", json={"inputs": PROMPT, "parameters": {**small, "eviction": "boom@0.5"}})
            assert g.status_code == 422 and g.json()["error"].startswith("parameters.eviction:")
            assert c.get("/health").status_code == 200 and s.service.admission.count == 0
    finally:
        s.stop()


def test_max_request_seconds_ends_a_stream_with_an_error_record() -> None:
    s = LiveServer(max_request_seconds=0.5, max_new_tokens=2000)
    try:
        with httpx.Client(base_url=s.url, timeout=30) as c:
            lines = _trace(c, {"inputs": PROMPT, "candidate": "snapkv@0.5", "replicates": 16,
                               "parameters": {"max_new_tokens": 1800}})
            last = json.loads(lines[-1])
            assert last["type"] == "error" and last["error_type"] == "timeout"
            assert "max-request-seconds" in last["error"]
            with pytest.raises(ValueError):
                assemble(lines)
            for _ in range(100):
                if s.service.admission.count == 0:
                    break
                time.sleep(0.05)
            assert s.service.admission.count == 0 and s.service.metrics.timeouts._value.get() == 1
    finally:
        s.stop()


def test_kvdiv_serve_cli_prints_ready_url_and_serves(tmp_path) -> None:
    from kvdiv.server_process import ServerProcess

    args = ["--model", "tiny:llama", "--port", "0", "--log-level", "warning"]
    with ServerProcess(args, tmp_path / "serve.log", env={"OMP_WAIT_POLICY": "PASSIVE"}) as server:
        url = server.wait_ready(60)   # the ready line's URL, answering /health
        assert url.startswith("http://127.0.0.1:")
        assert httpx.get(url + "/health", timeout=10).json()["model"] == "tiny:llama"
        assert server.exit_reason() is None
    assert server.proc.poll() is not None and "kvdiv serve ready: " + url in (tmp_path / "serve.log").read_text()


def test_kvpress_warnings_reach_the_log_once(caplog):
    """kvpress warns "Model ... not tested" at every press it applies; `kvdiv serve` logs
    each such line once (called twice, it installs one filter)."""
    import logging

    from gen_service.api.cli import _quiet_libraries

    _quiet_libraries()
    _quiet_libraries()
    press_log = logging.getLogger("kvpress.presses.base_press")
    with caplog.at_level(logging.WARNING, logger="kvpress.presses.base_press"):
        for _ in range(3):
            press_log.warning("Model %s not tested", "Gemma3ForCausalLM")
        press_log.warning("another message")
    assert [r.getMessage() for r in caplog.records] == ["Model Gemma3ForCausalLM not tested", "another message"]
