"""The HTTP side of policies: /v1/policies lists every press; policy ids are checked
before anything streams; context + question on /v1/traces; server-side press options."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

import functools
import json
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from gen_service.api.cli import build_service

pytestmark = pytest.mark.service

CONTEXT = "The quick brown fox jumps over the lazy dog; a lazy dog sleeps under the old tree. " * 2


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    app, _ = build_service("tiny:llama", max_new_tokens=64, max_replicates=8,
                           press_option=("ExpectedAttentionStatsPress:stats_folder=/nonexistent",))
    with TestClient(app) as c:
        yield c


def test_policies_lists_every_press(client: TestClient) -> None:
    import kvpress

    body = client.get("/v1/policies").json()
    names = {p["name"] for p in body["presses"]}
    assert names == {n for n in kvpress.__all__ if n.endswith("Press")}
    adakv = next(p for p in body["presses"] if p["name"] == "AdaKVPress")
    assert adakv["coupled"] and adakv["residual"] and adakv["example"].startswith("kvpress:AdaKVPress(")


@pytest.mark.parametrize("candidate, words", [
    ("snapkv#3000000000", "2147483647"),
    ("snapkv@0.5:window_size=true", "window_size"),
    ("kvpress:ExpectedAttentionPress@0.5:stats_folder=/etc", "stats_folder"),
    ("kvpress:QFilterPress@0.5", "--press-option"),
    ("snapkv#4096", "context"),
])
def test_bad_policy_is_422_before_streaming(client: TestClient, candidate: str, words: str) -> None:
    r = client.post("/v1/traces", json={"inputs": CONTEXT, "candidate": candidate})
    assert r.status_code == 422 and words in r.text, r.text


def test_context_and_question(client: TestClient) -> None:
    body = {"context": CONTEXT, "question": "Who sleeps?", "candidate": "adakv@0.5", "kind": "residual",
            "replicates": 2, "parameters": {"max_new_tokens": 4, "seed": 1}}
    r = client.post("/v1/traces", json=body)
    assert r.status_code == 200, r.text
    head = json.loads(r.text.splitlines()[0])
    assert head["question_tokens"] > 0 and head["prompt_tokens"] > head["question_tokens"]
    r = client.post("/v1/traces", json={"question": "Who?", "inputs": "x", "candidate": "snapkv@0.5"})
    assert r.status_code == 422 and r.json()["error"].startswith("question:")
    r = client.post("/v1/traces", json={"context": CONTEXT, "inputs": "x", "candidate": "snapkv@0.5"})
    assert r.status_code == 422 and r.json()["error"].startswith("context:")
    r = client.post("/v1/traces", json={"context": " ", "candidate": "snapkv@0.5"})
    assert r.status_code == 422 and r.json()["error"].startswith("context:")
    r = client.post("/v1/traces", json={"context": CONTEXT * 20, "candidate": "snapkv@0.5",
                                        "parameters": {"max_new_tokens": 4}})  # beyond tiny:llama's context
    assert r.status_code == 422 and r.json()["error"].startswith("context:"), r.text


def test_server_side_option_reaches_the_press(client: TestClient) -> None:
    """`--press-option` supplies the artifact path; a request never can."""
    registry = client.app.state.service.engine.registry
    policy = registry.build("kvpress:ExpectedAttentionStatsPress@0.5")
    assert policy.root.kwargs["stats_folder"] == "/nonexistent"


# The robustness probe's inputs that reached kvpress before policies were built up
# front (issue 10): each is a 422 from the check before streaming, on both routes,
# before the model thread sees the request and before any of these presses is built.
PROBES = [
    ("snapkv@0.5:window_size=true", "window_size"),
    ("recent@0.5:n_sink=-5", "n_sink"),
    ("kvpress:ExpectedAttentionStatsPress@0.5:stats_folder=/etc", "stats_folder"),
    ("kvpress:ExpectedAttentionStatsPress@0.5:dataset_name=x/y", "dataset_name"),
    ("kvpress:QFilterPress@0.5", "--press-option"),
    ("kvpress:KVzapPress@0.5", "--press-option"),
    ("kvpress:RestoreKVPress@0.5", "--press-option"),
]


@pytest.mark.parametrize("route", ["/v1/traces", "/generate"])
@pytest.mark.parametrize("candidate, words", PROBES)
def test_probe_inputs_refused_before_kvpress_runs(client: TestClient, monkeypatch: pytest.MonkeyPatch,
                                                  route: str, candidate: str, words: str) -> None:
    import kvpress

    engine = client.app.state.service.engine
    reached: list[str] = []

    def record(name: str, original):
        # wraps: the policy checks read each press's signature and type hints (cached)
        @functools.wraps(original)
        def fail(*args, **kwargs):
            reached.append(name)
            raise AssertionError(f"{name} reached")
        return fail

    for name in ("SnapKVPress", "StreamingLLMPress", "ExpectedAttentionStatsPress", "QFilterPress", "KVzapPress",
                 "RestoreKVPress"):
        cls = getattr(kvpress, name)
        monkeypatch.setattr(cls, "__init__", record(name, cls.__init__))
    monkeypatch.setattr(engine, "trace", record("engine.trace", engine.trace))
    monkeypatch.setattr(engine, "generate", record("engine.generate", engine.generate))
    if route == "/generate":
        body = {"inputs": CONTEXT, "parameters": {"max_new_tokens": 2, "eviction": candidate}}
        field = "parameters.eviction"
    else:
        body = {"inputs": CONTEXT, "candidate": candidate, "parameters": {"max_new_tokens": 2}}
        field = "candidate"
    r = client.post(route, json=body)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error.startswith(f"{field}:") and words in error and "cannot run on this prompt" not in error, error
    assert not reached
