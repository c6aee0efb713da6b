"""Designed refusals over HTTP (issue 41): ``/v1/policies`` lists the presses refused on the
loaded model with the feature and what would be needed; a request for one gets a 422
marked ``permanent``; the start-up self-check runs a compressed press too and, where it
fails, starts with that press family refused; the collector reports the refused
(document, policy) pairs once and retries none of them."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

from collections.abc import Iterator
from pathlib import Path

import pytest
from conformance_models import BY_NAME, loaded
from starlette.testclient import TestClient

pytestmark = pytest.mark.service

CONTEXT = "The quick brown fox jumps over the lazy dog; a lazy dog sleeps under the old tree. " * 2


def _serve(monkeypatch: pytest.MonkeyPatch, family: str, **kw):
    """build_service over a conformance family's tiny model (the self-check included)."""
    import gen_service.models.loading as loading
    from gen_service.api.cli import build_service

    lm = loaded(BY_NAME[family])
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: lm)
    return build_service("tiny:llama", max_new_tokens=64, max_replicates=4, **kw)


@pytest.fixture(scope="module")
def phi3() -> Iterator[tuple[TestClient, object]]:
    with pytest.MonkeyPatch.context() as mp:
        app, service = _serve(mp, "phi3_partial")
    with TestClient(app) as client:
        yield client, service


def test_policies_lists_the_presses_refused_on_the_loaded_model(phi3) -> None:
    client, service = phi3
    body = client.get("/v1/policies").json()
    assert body["model"] == "conformance:phi3_partial"
    think = body["refused"]["ThinKPress"]
    assert think["model"] == "Phi3ForCausalLM" and think["feature"].startswith("partial rotary")
    assert "apply_rotary_pos_emb" in think["needed"] and think["reason"].startswith("ThinKPress cannot run")
    rows = {p["name"]: p for p in body["presses"]}
    assert rows["SnapKVPress"]["runs_here"] and not rows["ThinKPress"]["runs_here"]
    assert not rows["BasePress"]["runs_here"]
    # the self-check ran SnapKV's window attention through partial rotary, and it passed
    assert service.self_check.compression == [{"policy": "snapkv@0.5", "family": "window_attention",
                                               "passed": True, "refused": None}]


def test_a_refused_press_is_a_permanent_422_and_a_bad_parameter_is_not(phi3) -> None:
    client, _ = phi3
    r = client.post("/v1/traces", json={"inputs": CONTEXT, "candidate": "think@0.5"})
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["permanent"] is True and body["error"].startswith("candidate: policy 'think@0.5': ThinKPress")
    assert "partial rotary" in body["error"] and "it would need" in body["error"]
    grouped = client.post("/v1/traces", json={"inputs": CONTEXT, "candidates": ["snapkv@0.5", "think@0.5"],
                                               "seeds": [1, 2], "parameters": {"max_new_tokens": 2}})
    assert grouped.status_code == 422 and grouped.json()["permanent"] is True
    assert grouped.json()["error"].startswith("candidates[1]:")
    bad = client.post("/v1/traces", json={"inputs": CONTEXT, "candidate": "snapkv@0.5:window_size=true"})
    assert bad.status_code == 422 and "permanent" not in bad.json()
    ok = client.post("/v1/traces", json={"inputs": CONTEXT, "candidate": "snapkv@0.5", "replicates": 2,
                                         "parameters": {"max_new_tokens": 3, "seed": 1}})
    assert ok.status_code == 200, ok.text


def test_the_self_check_refuses_window_attention_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model on which SnapKV's window attention fails (planted: it raises as kvpress did on
    partial rotary) starts, with every window-attention press refused, the failure the reason."""
    import gen_service.presses.rotary as rotary

    def broken(module, hidden_states, keys, window_size, position_embeddings):
        raise RuntimeError("The size of tensor a (32) must match the size of tensor b (16) at non-singleton "
                           "dimension 3")

    monkeypatch.setattr(rotary, "window_attention", broken)
    try:
        app, service = _serve(monkeypatch, "llama")
    finally:
        monkeypatch.undo()
        rotary.install()    # kvdiv's window attention back for the other tests
    probe = service.self_check.compression[0]
    assert probe["policy"] == "snapkv@0.5" and not probe["passed"]
    assert "self-check's snapkv@0.5 failed" in probe["refused"] and "must match the size" in probe["refused"]
    with TestClient(app) as client:
        refused = client.get("/v1/policies").json()["refused"]
        assert {"SnapKVPress", "PyramidKVPress", "AdaKVPress", "TOVAPress", "FinchPress", "SimLayerKVPress",
                "ChunkKVPress"} <= set(refused)
        assert "KnormPress" not in refused
        r = client.post("/v1/traces", json={"inputs": CONTEXT, "candidate": "pyramidkv@0.5"})
        assert r.status_code == 422 and r.json()["permanent"] is True and "self-check" in r.json()["error"]
        info = client.get("/info").json()["kvdiv"]["self_check"]
        assert info["passed"] and info["compression"][0]["passed"] is False


def test_a_collection_reports_the_refused_pairs_once_and_retries_none(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    """Against a live server over Phi-3 partial rotary: think@0.5 is refused by design; the
    collection finishes with snapkv complete and think's three pairs reported once."""
    from service_live import LiveServer

    import gen_service.models.loading as loading
    from collector import documents as D
    from collector.collect import CollectConfig, collect

    lm = loaded(BY_NAME["phi3_partial"])
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: lm)
    server = LiveServer(max_new_tokens=64, self_check=False)
    sent: list[str] = []
    build = server.service.intake.build   # where every request's policies are built (serving/intake.py)
    monkeypatch.setattr(server.service.intake, "build",
                        lambda field, policy, n: sent.append(policy) or build(field, policy, n))
    try:
        docs = D.write_jsonl([D.Document(f"doc{i}", f"Paragraph {i}. " * 6) for i in range(3)],
                             tmp_path / "docs.jsonl")
        cfg = CollectConfig.flat(servers=[server.url], docs_file=docs, policies=["snapkv@0.5", "think@0.5"],
                                 out=tmp_path / "run", kind="coupled", replicates=2, max_new_tokens=3, seed=1,
                                 progress=False, backoff_s=0.01, max_attempts=4, concurrency=1)
        result = collect(cfg)
    finally:
        server.stop()
    assert result.completed == 3 and not result.failed and not result.retry_helps and not result.ok
    reason, documents = result.refused["think@0.5"]
    assert sorted(documents) == ["doc0", "doc1", "doc2"] and "ThinKPress" in reason and "partial rotary" in reason
    assert sent.count("think@0.5") == 1, sent     # asked once: never retried, never sent for the others
    assert result.summary().count("REFUSED") == 1 and result.retries == 0
