"""Presses whose learned artifact the operator supplies as local files
(``--press-option RestoreKVPress:path=DIR``, ``QFilterPress:path=DIR``): they run in
both kinds from random-initialised artifacts written here for tiny:llama, match
kvpress's own press given the same files, never download, and leave the reference's
forwards untouched."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

from pathlib import Path

import pytest
import torch
from press_artifact_files import write_artifacts

from gen_service.engine.facade import Engine
from gen_service.engine.jobs import TraceJob
from gen_service.errors import PolicyError
from gen_service.models.loading import load_model
from gen_service.presses.registry import PolicyRegistry

CONTEXT = "The quick brown fox jumps over the lazy dog; a lazy dog sleeps under the old tree. " * 3
QUESTION = "Who sleeps?"


@pytest.fixture(scope="module")
def options(tmp_path_factory) -> dict[str, dict[str, str]]:
    return write_artifacts(tmp_path_factory.mktemp("artifacts"))


@pytest.fixture(scope="module")
def engine(options) -> Engine:
    return Engine(load_model("tiny:llama"), PolicyRegistry(press_options=options))


def _no_download(monkeypatch) -> None:
    import huggingface_hub

    def refuse(*args, **kwargs):
        raise AssertionError("a press tried to download")

    for name in ("hf_hub_download", "snapshot_download"):
        monkeypatch.setattr(huggingface_hub, name, refuse)
    monkeypatch.setattr("kvpress.presses.restorekv_press.hf_hub_download", refuse)


@pytest.mark.parametrize("policy", ["kvpress:RestoreKVPress@0.5", "kvpress:QFilterPress@0.5",
                                    "kvpress:ExpectedAttentionStatsPress@0.5"])
def test_runs_in_both_kinds_without_downloading(engine: Engine, policy: str, monkeypatch) -> None:
    _no_download(monkeypatch)
    prompt = list(engine.lm.tokenizer(CONTEXT).input_ids)
    for kind in ("coupled", "residual"):
        recs = list(engine.trace(TraceJob(prompt_ids=prompt, candidate=policy, kind=kind, horizon=5, replicates=3,
                                          seed=2)))
        assert recs[0]["candidate"]["press"] == policy.split(":")[1].split("@")[0]
        assert max(recs[1]["tv"]) == 0.0 and max(max(r["tv"]) for r in recs[2:] if r["type"] != "branch") > 0


def test_restorekv_appends_restore_tokens_and_leaves_the_model_as_it_was(engine: Engine, options) -> None:
    prompt = list(engine.lm.tokenizer(CONTEXT).input_ids)
    full = engine.registry.build("full")
    before = Engine(load_model("tiny:llama")).prefill(full, prompt)     # the same weights, no adapter
    restore = engine.prefill(engine.registry.build("kvpress:RestoreKVPress@0.5"), prompt)
    # the n restore tokens' keys/values follow the context in every layer
    assert [layer.keys.shape[-2] for layer in restore.cache.layers] == [len(prompt) + 8] * 2
    assert "restorekv" in engine.model.peft_config
    after = engine.prefill(full, prompt)
    # the adapter acts only in the restore pass: the full model's forwards are bit-identical
    assert torch.equal(before.logits, after.logits)
    for a, b in zip(before.cache.layers, after.cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_restorekv_equals_kvpress_loading_the_same_files(engine: Engine, options, monkeypatch) -> None:
    """kvpress's own loader (hub look-ups answered from the operator's folder) and ours
    give the same traces. (kvpress's pipeline itself cannot run KVzip-family presses on
    the random tiny model: its fake-key attention patch finds no key that masks every
    query, so the reference is kvpress's press in our engine.)"""
    folder = Path(options["RestoreKVPress"]["path"])
    model = engine.model
    load_adapter = model.load_adapter
    calls: list[str] = []

    def hub_file(repo: str, name: str) -> str:
        calls.append(repo)
        return str(folder / name)

    monkeypatch.setattr("kvpress.presses.restorekv_press.hf_hub_download", hub_file)
    monkeypatch.setattr(model, "load_adapter", lambda repo, adapter_name: load_adapter(str(folder),
                                                                                       adapter_name=adapter_name))
    hub = Engine(engine.lm, PolicyRegistry(press_options={"RestoreKVPress": {"allow_download": True}}))
    prompt = list(engine.lm.tokenizer(CONTEXT).input_ids)
    question = list(engine.lm.tokenizer(QUESTION).input_ids)
    for kind in ("coupled", "residual"):
        job = dict(prompt_ids=prompt, question_ids=question, candidate="kvpress:RestoreKVPress@0.5", kind=kind,
                   horizon=6, replicates=4, seed=5)
        ours = list(engine.trace(TraceJob(**job)))[1:]
        theirs = list(hub.trace(TraceJob(**job)))[1:]
        assert ours == theirs, kind
    assert calls and calls[0].startswith("higokri/RestoreKV-")   # kvpress's loader did run


def test_without_the_artifact_a_request_is_refused_naming_the_option(options, tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="--press-option RestoreKVPress"):
        PolicyRegistry().build("kvpress:RestoreKVPress@0.5")
    # the _plus variant needs its own adapter
    with pytest.raises(PolicyError, match="RestoreKVPress:plus_path=DIR"):
        PolicyRegistry(press_options=options).build("kvpress:RestoreKVPress@0.5:kvzip_plus_normalization=true")
    # a folder without the files is refused when the server starts
    with pytest.raises(PolicyError, match="restore_embeddings.safetensors"):
        PolicyRegistry(press_options={"RestoreKVPress": {"path": str(tmp_path)}})
    with pytest.raises(PolicyError, match="takes no local artifact"):
        PolicyRegistry(press_options={"SnapKVPress": {"path": str(tmp_path)}})
    # never from a request
    with pytest.raises(PolicyError):
        PolicyRegistry(press_options=options).build(f"kvpress:QFilterPress@0.5:path={tmp_path}")


@pytest.mark.service
def test_serve_press_option_supplies_the_folder(options) -> None:
    """`kvdiv serve --press-option RestoreKVPress:path=DIR`, end to end over HTTP."""
    from starlette.testclient import TestClient

    from gen_service.api.cli import build_service

    app, _ = build_service("tiny:llama", max_new_tokens=8, max_replicates=4,
                           press_option=(f"RestoreKVPress:path={options['RestoreKVPress']['path']}",))
    with TestClient(app) as client:
        body = {"inputs": CONTEXT, "candidate": "kvpress:RestoreKVPress@0.5", "kind": "residual", "replicates": 2,
                "parameters": {"max_new_tokens": 4, "seed": 1}}
        r = client.post("/v1/traces", json=body)
        assert r.status_code == 200, r.text
        r = client.post("/v1/traces", json={**body, "candidate": "kvpress:QFilterPress@0.5"})
        assert r.status_code == 422 and "--press-option QFilterPress" in r.json()["error"], r.text
