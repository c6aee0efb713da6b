"""``CollectConfig`` nested into records (collector/config.py): the flat names still build it,
every problem is reported at once with its flag, and the journal's stored form is unchanged, so a
journal written by the flat config resumes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from test_collector_support import POLICIES, FakeServer, small_config, write_docs

from collector.collect import collect, prepare_run
from collector.config import FLAT_NAMES, CollectConfig, PoolConfig, RetryConfig, RoundConfig, Sampling
from collector.errors import ConfigError

#: CollectConfig's fields when it was flat (before the records), with their defaults.
OLD_FLAT = dict(kind="residual", replicates=8, max_new_tokens=32, window=None, temperature=1.0, top_k=None,
                top_p=None, seed=0, common_random_numbers=False, template="summarise", api_key=None, concurrency=1,
                max_attempts=6, backoff_s=0.5, backoff_max_s=30.0, read_timeout_s=600.0, request_timeout_s=3600.0,
                progress=True, servers_file=None, servers_poll_s=2.0, wait_for_servers_s=300.0, server_backoff_s=1.0,
                server_backoff_max_s=60.0, round_index=0, allocation=None, group_candidates=True)
REQUIRED = dict(servers=["http://x"], docs_file=Path("d.jsonl"), policies=["snapkv@0.5"], out=Path("o"))


def _flat_view(cfg: CollectConfig) -> dict[str, object]:
    """The config's values under the old flat names."""
    view = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in ("sampling", "retry",
                                                                                              "pool", "round")}
    view.update({name: getattr(getattr(cfg, record), key) for name, (record, key) in FLAT_NAMES.items()})
    return view


def test_every_old_field_has_a_place_and_its_default() -> None:
    assert len(OLD_FLAT) + len(REQUIRED) == 30   # the flat config's fields: 4 required, 26 with defaults
    view = _flat_view(CollectConfig(**REQUIRED))
    assert {k: view[k] for k in OLD_FLAT} == OLD_FLAT
    # control and top_logprobs: added since, off by default
    assert set(view) == set(OLD_FLAT) | set(REQUIRED) | {"control", "top_logprobs"}
    assert view["control"] is False and view["top_logprobs"] == 0


def test_flat_names_build_the_nested_config() -> None:
    flat = CollectConfig.flat(**REQUIRED, temperature=0.5, top_k=4, seed=9, common_random_numbers=True,
                              max_attempts=2, backoff_s=0.1, request_timeout_s=None, concurrency=3, api_key="k",
                              servers_file="s.txt", group_candidates=False, round_index=1,
                              allocation={"d": {"snapkv@0.5": 2}})
    nested = CollectConfig(**REQUIRED, sampling=Sampling(temperature=0.5, top_k=4, seed=9, common_random_numbers=True),
                           retry=RetryConfig(max_attempts=2, backoff_s=0.1, request_timeout_s=None),
                           pool=PoolConfig(servers_file=Path("s.txt"), concurrency=3, api_key="k",
                                           group_candidates=False),
                           round=RoundConfig(1, {"d": {"snapkv@0.5": 2}}))
    assert flat == nested and flat.pool.servers_file == Path("s.txt")
    with pytest.raises(dataclasses.FrozenInstanceError):
        flat.sampling.seed = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        CollectConfig.flat(**REQUIRED, max_attempt=2)
    later = CollectConfig(**REQUIRED).for_round(2, {"d": {"snapkv@0.5": 1}})
    assert later.round == RoundConfig(2, {"d": {"snapkv@0.5": 1}}) and later.replicates_for("d", "snapkv@0.5") == 1


def test_every_problem_is_reported_at_once_with_its_flag() -> None:
    with pytest.raises(ConfigError) as err:
        CollectConfig.flat(servers=[], docs_file="d", policies=["a", "a"], out="o", kind="both", template="poem",
                           replicates=0, window=40, temperature=-1, request_timeout_s=0, wait_for_servers_s=-1,
                           round_index=-1)
    message = str(err.value)
    for flag in ("--server", "duplicate policies", "--kind", "--template", "--replicates", "--window",
                 "--temperature", "--request-timeout", "round_index", "--wait-for-servers"):
        assert flag in message, flag


def test_the_stored_parameters_keep_the_flat_form() -> None:
    cfg = CollectConfig.flat(**REQUIRED, replicates=4, max_new_tokens=8, window=5, seed=3, top_p=0.9)
    assert cfg.params("abc") == {
        "policies": ["snapkv@0.5"], "kind": "residual", "replicates": 4, "max_new_tokens": 8, "window": 5,
        "temperature": 1.0, "top_k": None, "top_p": 0.9, "seed": 3, "template": "summarise", "docs_sha256": "abc",
        "reference": "full"}
    assert CollectConfig.flat(**REQUIRED, common_random_numbers=True).params("abc")["common_random_numbers"] is True


def test_a_journal_written_with_the_flat_config_resumes(tmp_path: Path) -> None:
    docs_file = write_docs(tmp_path / "docs.jsonl")
    with FakeServer() as server:
        run = tmp_path / "run"
        assert collect(small_config([server.url], docs_file, run)).completed == 6
        # The manifest exactly as the flat CollectConfig wrote it (format, params, extra keys).
        digest = json.loads((run / "manifest.json").read_text())["params"]["docs_sha256"]
        old = {"concurrency": 1, "created": "2026-01-01T00:00:00Z", "docs_file": str(docs_file),
               "documents": "documents.jsonl", "format": "kvdiv.collection/1", "model": "fake-model", "n_docs": 3,
               "params": {"docs_sha256": digest, "kind": "residual", "max_new_tokens": 6, "policies": POLICIES,
                          "reference": "full", "replicates": 2, "seed": 7, "temperature": 1.0,
                          "template": "summarise", "top_k": None, "top_p": None, "window": 4},
               "servers": [server.url], "servers_file": None, "updated": "2026-01-01T00:00:00Z"}
        (run / "manifest.json").write_text(json.dumps(old, indent=2, sort_keys=True) + "\n")
        prepare_run(small_config([server.url], docs_file, run))   # no ManifestMismatch
        again = collect(small_config([server.url], docs_file, run))
        assert again.ok and again.completed == 0 and again.skipped == 6
        assert json.loads((run / "manifest.json").read_text())["params"] == old["params"]
