"""The OpenAI-compatible Messages API, TGI's sampling knobs and a server no input can break,
on a live loopback uvicorn over the tiny model."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from service_live import PROMPT, LiveServer

pytestmark = pytest.mark.service

CHAT = [{"role": "user", "content": "Say something about foxes."}]
EVICTIONS = [None, "snapkv@0.5"]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    s = LiveServer(max_new_tokens=64, max_replicates=8, body_timeout_s=1.0, max_input_bytes=300_000)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def _extra(eviction: str | None) -> dict | None:
    return None if eviction is None else {"eviction": eviction}


# ---------------------------------------------------------------------- official clients


@pytest.mark.parametrize("eviction", EVICTIONS)
def test_openai_client_chat_stream_completions_models(server: LiveServer, eviction: str | None) -> None:
    from openai import OpenAI

    oa = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    chat = oa.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, seed=3, temperature=0.8,
                                      logprobs=True, top_logprobs=2, extra_body=_extra(eviction))
    choice = chat.choices[0]
    assert chat.usage.completion_tokens == 5 and choice.finish_reason == "length"
    assert len(choice.logprobs.content) == 5 and len(choice.logprobs.content[0].top_logprobs) == 2
    chunks = list(oa.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, seed=3, temperature=0.8,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body=_extra(eviction)))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # same seed, same tokens, streamed or not
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-2].choices[0].finish_reason == "length"
    comp = oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, seed=1, extra_body=_extra(eviction))
    assert comp.usage.completion_tokens == 4 and isinstance(comp.choices[0].text, str)
    streamed = list(oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, seed=1, stream=True,
                                          extra_body=_extra(eviction)))
    assert "".join(c.choices[0].text for c in streamed) == comp.choices[0].text
    assert [m.id for m in oa.models.list()] == ["tiny:llama"]


@pytest.mark.parametrize("eviction", EVICTIONS)
def test_huggingface_hub_chat_completion(server: LiveServer, eviction: str | None) -> None:
    from huggingface_hub import InferenceClient

    hub = InferenceClient(base_url=server.url, timeout=30)
    out = hub.chat_completion(CHAT, max_tokens=4, seed=5, temperature=0.7, extra_body=_extra(eviction))
    assert out.usage.completion_tokens == 4 and out.choices[0].message.role == "assistant"
    stream = list(hub.chat_completion(CHAT, max_tokens=4, seed=5, temperature=0.7, stream=True,
                                      extra_body=_extra(eviction)))
    assert "".join(c.choices[0].delta.content or "" for c in stream) == out.choices[0].message.content


def test_eviction_changes_the_chat_kernel(client: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "temperature": 0}
    full = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    evicted = client.post("/v1/chat/completions", json={**body, "eviction": "recent@0.1"})
    assert evicted.status_code == 200 and isinstance(evicted.json()["choices"][0]["message"]["content"], str)
    assert client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"] == full


def test_chat_tokenize(client: httpx.Client) -> None:
    r = client.post("/chat_tokenize", json={"messages": CHAT}).json()
    assert r["templated_text"].startswith("<|im_start|>user\n") and r["templated_text"].endswith("assistant\n")
    assert "".join(t["text"] for t in r["tokenize_response"]) == r["templated_text"]


# ---------------------------------------------------------------------- TGI's knobs


# TGI's OpenAPI document (v2.4.1), GenerateParameters' example values, with
# decoder_input_details and details on (to get prefill), and watermark off: the
# document's example has watermark true, which this server refuses by name.
TGI_EXAMPLE = {"inputs": "My name is Olivier and I", "parameters": {
    "best_of": 1, "decoder_input_details": True, "details": True, "do_sample": True, "frequency_penalty": 0.1,
    "max_new_tokens": 20, "repetition_penalty": 1.03, "return_full_text": False, "seed": None,
    "stop": ["photographer"], "temperature": 0.5, "top_k": 10, "top_n_tokens": 5, "top_p": 0.95,
    "truncate": None, "typical_p": 0.95, "watermark": False}}


def test_tgi_documented_example(client: httpx.Client) -> None:
    r = client.post("/generate", json=TGI_EXAMPLE)
    assert r.status_code == 200, r.text
    det = r.json()["details"]
    assert len(det["prefill"]) > 5 and det["prefill"][0]["logprob"] is None
    assert len(det["top_tokens"]) == det["generated_tokens"] and all(len(t) == 5 for t in det["top_tokens"])
    for name, value in (("watermark", True), ("grammar", {"type": "regex", "value": "a+"}), ("best_of", 2)):
        bad = client.post("/generate", json={**TGI_EXAMPLE, "parameters": {**TGI_EXAMPLE["parameters"], name: value}})
        assert bad.status_code == 422 and bad.json()["error"].startswith(f"parameters.{name}:")


def test_penalties_change_generate_and_are_reproducible(client: httpx.Client) -> None:
    def run(**params) -> list[int]:
        body = {"inputs": "aaaa", "parameters": {"max_new_tokens": 12, "details": True, **params}}
        r = client.post("/generate", json=body)
        assert r.status_code == 200, r.text
        return [t["id"] for t in r.json()["details"]["tokens"]]

    greedy = run()
    assert run(repetition_penalty=50.0) != greedy  # the greedy path repeats; a heavy penalty forbids it
    assert run(frequency_penalty=2.0, presence_penalty=2.0) != greedy
    assert run(typical_p=0.5, seed=3) == run(typical_p=0.5, seed=3)


def test_stop_truncate_return_full_text(client: httpx.Client) -> None:
    base = {"max_new_tokens": 6, "details": True, "seed": 1, "do_sample": True}
    r = client.post("/generate", json={"inputs": PROMPT, "parameters": base}).json()
    first = r["details"]["tokens"][0]["text"]
    stopped = client.post("/generate", json={"inputs": PROMPT, "parameters": {**base, "stop": [first]}}).json()
    assert stopped["details"]["finish_reason"] == "stop_sequence" and stopped["details"]["generated_tokens"] == 1
    full = client.post("/generate", json={"inputs": PROMPT, "parameters": {**base, "return_full_text": True}}).json()
    assert full["generated_text"] == PROMPT + r["generated_text"]
    cut = client.post("/generate", json={"inputs": PROMPT, "parameters": {**base, "truncate": 5,
                                                                            "decoder_input_details": True}})
    assert len(cut.json()["details"]["prefill"]) == 5


def test_trace_with_penalties_each_side_its_own_history(client: httpx.Client) -> None:
    from protocols import assemble

    body = {"inputs": PROMPT, "candidate": "recent@0.3", "replicates": 4,
            "parameters": {"max_new_tokens": 6, "seed": 2, "repetition_penalty": 1.5, "typical_p": 0.9}}
    r = client.post("/v1/traces", json=body)
    assert r.status_code == 200, r.text
    ds = assemble(r.text)
    assert json.loads(r.text.splitlines()[0])["sampling"]["repetition_penalty"] == 1.5
    assert float(ds["tv"].isel(step=0).max()) == 0.0  # prefill compression: step 1 is the full model's
    res = client.post("/v1/traces", json={**body, "kind": "residual"})
    assert res.status_code == 200 and assemble(res.text).attrs["kind"] == "residual"


# ---------------------------------------------------------------------- inputs that used to break the server


DEEP = b'{"inputs": "a", "parameters": {"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}"
BAD_INPUTS = [  # (route, raw body, field named first in the error)
    ("/generate", DEEP, "body"),
    ("/generate", b'{"inputs": "a", "parameters": {"max_new_tokens": ' + b"1" * 5000 + b"}}", "body"),
    ("/generate", b'{"inputs": "a", "parameters": {"temperature": 1e999}}', "body"),
    ("/generate", b'{"inputs": "a", "parameters": {"temperature": NaN}}', "body"),
    ("/generate", b'{"inputs": "ab\\ud800"}', "inputs"),
    ("/v1/traces", b'{"messages": [{"role": "user", "content": "\\ud800"}], "candidate": "full"}',
     "messages[0].content"),
    ("/tokenize", b'{"inputs": "\\ud800"}', "inputs"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\udfff"}]}', "messages[0].content"),
    ("/", b'{"inputs": "abc", "stream": [null, null]}', "stream"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "n": 2}', "n"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "tools": []}', "tools"),
]


def _policy_body(route: str, policy: str) -> bytes:
    if route == "/generate":
        return json.dumps({"inputs": PROMPT, "parameters": {"max_new_tokens": 3, "eviction": policy}}).encode()
    return json.dumps({"inputs": PROMPT, "candidate": policy, "parameters": {"max_new_tokens": 3}}).encode()


BAD_POLICIES = [  # policy ids that reached kvpress and failed after the 200 (or with a 500)
    ("/generate", "snapkv@0.5:window_size=abc"), ("/generate", "recent@0.5:n_sink=abc"),
    ("/v1/traces", "snapkv@0.5:window_size=abc"), ("/v1/traces", "recent@0.5:n_sink=abc"),
    *[("/v1/traces", f"snapkv@0.5:window_size={v}") for v in ("0", "-5", "1.5", "nan")],
    ("/v1/traces", "kvpress:SnapKVPress@0.5:kernel_size=0"), ("/v1/traces", "kvpress:SnapKVPress@0.5:kernel_size=abc"),
    ("/v1/traces", "kvpress:ScorerPress@0.5"), ("/v1/traces", "kvpress:FinchPress@0.5:window_size=0"),
    ("/v1/traces", "snapkv#3000000000"),
]


@pytest.mark.parametrize("route, body, field", BAD_INPUTS)
def test_bad_input_is_a_422_naming_the_field(client: httpx.Client, route: str, body: bytes, field: str) -> None:
    r = client.post(route, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["error"].startswith(f"{field}:") and r.json()["error_type"] == "validation"


@pytest.mark.parametrize("route, policy", BAD_POLICIES)
def test_bad_policy_is_a_422_before_streaming(client: httpx.Client, route: str, policy: str) -> None:
    r = client.post(route, content=_policy_body(route, policy), headers={"content-type": "application/json"})
    field = "parameters.eviction" if route == "/generate" else "candidate"
    assert r.status_code == 422, r.text
    assert r.json()["error"].startswith(f"{field}:")


def test_extreme_but_valid_values_work(client: httpx.Client) -> None:
    for t in (1e-300, 1e-45):
        assert client.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2,
                                                                               "temperature": t}}).status_code == 200
        r = client.post("/v1/traces", json={"inputs": PROMPT, "candidate": "snapkv@0.5",
                                            "parameters": {"max_new_tokens": 2, "temperature": t}})
        assert r.status_code == 200 and json.loads(r.text.splitlines()[-1])["type"] == "end"
    r = client.post("/v1/traces", json={"inputs": PROMPT, "candidate": "snapkv@0.5", "seed": 2**64})
    assert r.status_code == 422 and r.json()["error"].startswith("seed:")


def test_input_bytes_checked_before_tokenising(client: httpx.Client) -> None:
    r = client.post("/generate", json={"inputs": "a" * 300_001})
    assert r.status_code == 422 and "--max-input-bytes" in r.json()["error"]


def test_health_stays_fast_during_a_large_tokenize(client: httpx.Client, server: LiveServer) -> None:
    done: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: done.append(httpx.post(server.url + "/tokenize", timeout=60,
                                                                    json={"inputs": "a" * 250_000})))
    worker.start()
    slowest = 0.0
    while worker.is_alive():
        t0 = time.perf_counter()
        assert client.get("/health").status_code == 200
        slowest = max(slowest, time.perf_counter() - t0)
        time.sleep(0.02)
    assert done[0].status_code == 200 and len(done[0].json()) == 250_000
    assert slowest < 1.0  # measured ~0.1 s; the bound leaves room for a loaded CI machine


def test_slow_body_is_cut_off(server: LiveServer) -> None:
    host, port = server.url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n" + b"{" * 10)
        assert s.recv(64).startswith(b"HTTP/1.1 408")


def test_metrics_count_responses_by_route_and_status(client: httpx.Client) -> None:
    client.get("/no/such/route")
    client.get("/v1/traces")  # wrong method
    text = client.get("/metrics").text
    assert 'kvdiv_requests_total{route="other",status="404"}' in text
    assert 'kvdiv_requests_total{route="/v1/traces",status="405"}' in text


def test_empty_api_key_refuses_to_start() -> None:
    from click.testing import CliRunner

    from gen_service.api.cli import serve
    from gen_service.errors import ConfigError
    from gen_service.serving.service import ServiceConfig

    with pytest.raises(ConfigError, match="empty"):
        ServiceConfig(api_key="")
    result = CliRunner().invoke(serve, ["--model", "tiny:llama", "--api-key", ""], env={"KVDIV_API_KEY": None})
    assert result.exit_code != 0 and "API key is empty" in result.output
    result = CliRunner().invoke(serve, ["--model", "tiny:llama"], env={"KVDIV_API_KEY": " "})
    assert result.exit_code != 0 and "API key is empty" in result.output
