"""``kvdiv collect --kind reference``: the request, the run's parameters, and a live collection."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from collector import documents as D
from collector.collect import CollectConfig, collect
from collector.errors import ConfigError
from collector.jobs import request_body
from collector.pack import pack_run
from protocols import validate

REQUIRED = dict(servers=["http://x"], docs_file="d.jsonl", policies=["snapkv@0.5"], out="o")


def test_reference_runs_have_no_window() -> None:
    cfg = CollectConfig.flat(**REQUIRED, kind="reference", max_new_tokens=8)
    assert cfg.effective_window == 0 and cfg.params("abc")["window"] == 0
    body = request_body(cfg, D.Document("d1", "Text."), "snapkv@0.5")
    assert body["kind"] == "reference" and "window" not in body
    with pytest.raises(ConfigError, match="--window applies to residual traces"):
        CollectConfig.flat(**REQUIRED, kind="reference", max_new_tokens=8, window=4)


@pytest.fixture(scope="module")
def tiny_server() -> Iterator[str]:
    # tiny:llama in a thread of this process (a `kvdiv serve` child costs an interpreter
    # start; test_demo.py starts one): the collector only sees HTTP
    from service_live import LiveServer

    server = LiveServer()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.mark.service
@pytest.mark.parametrize("grouped", [False, True])
def test_collect_and_pack_reference_traces(tiny_server: str, tmp_path: Path, grouped: bool) -> None:
    """One request per (doc, policy) or one per document (candidates), the control with
    them: the packed dataset is a valid reference dataset whose control scores as P (to
    the rounding of P's and Q's forwards fused into one batch: the noise floor)."""
    docs = D.write_jsonl(D.select(D.pydoc_documents(None, target_tokens=60), 2), tmp_path / "docs.jsonl")
    cfg = CollectConfig.flat(servers=[tiny_server], docs_file=docs, policies=["snapkv@0.5", "recent@0.5"],
                             out=tmp_path / "run", kind="reference", replicates=3, max_new_tokens=6, seed=5,
                             progress=False, control=True, group_candidates=grouped)
    assert collect(cfg).completed == 6   # (doc, policy) streams, split back from grouped requests
    ds = validate(pack_run(tmp_path / "run", progress=False))
    assert ds.attrs["kind"] == "reference" and ds.attrs["window"] == 0
    assert list(ds.policy.values) == ["snapkv@0.5", "recent@0.5", "full"]
    assert ds.sizes == {"doc": 2, "policy": 3, "replicate": 3, "step": 6}
    full = ds.sel(policy="full")
    np.testing.assert_allclose(full.x_logp.values, full.x_logq.values, atol=1e-4)
    assert float(full.tv.max()) < 1e-3
    assert float(ds.sel(policy="snapkv@0.5").tv.max()) > 0
