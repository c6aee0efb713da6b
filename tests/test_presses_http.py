"""The HTTP side of policies: /v1/policies lists every press; policy ids are checked
before anything streams; context + question on /v1/traces; server-side press options."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

import json
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from gen_service.server_cli import build_service

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
    assert r.status_code == 422 and "question" in r.text


def test_server_side_option_reaches_the_press(client: TestClient) -> None:
    """`--press-option` supplies the artifact path; a request never can."""
    registry = client.app.state.service.engine.registry
    policy = registry.build("kvpress:ExpectedAttentionStatsPress@0.5")
    assert policy.root.kwargs["stats_folder"] == "/nonexistent"
