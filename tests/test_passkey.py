"""kvdiv.passkey: the demo's pass-key answers table, on a dataset with known answers."""

from __future__ import annotations

import numpy as np

from kvdiv.demo_spec import DEMO_STUDY
from kvdiv.passkey import answers_headline
from protocols import answer_variables, coupled_dataset

PASSKEY_POLICIES = DEMO_STUDY.trace_set("passkey").policies


def _scored(x: np.ndarray, y: np.ndarray, temperature: float = 0.0):
    n_doc, n_pol = x.shape
    tokens = np.ones((n_doc, n_pol, 1, 3), dtype=int)
    ds = coupled_dataset(np.zeros(tokens.shape), tokens, tokens, vocab_size=5, policies=list(PASSKEY_POLICIES),
                         sampling={"temperature": temperature})
    return ds.assign(answer_variables(n_doc, n_pol, 1, x_score=x[..., None], y_score=y[..., None],
                                      answers=[["1"]] * n_doc, scorer="ruler_all"))


def test_headline_counts_and_tests_each_policy():
    rng = np.random.default_rng(1)
    x = (rng.random((30, 3)) < 0.8).astype(float)
    y = x.copy()
    y[:, 0] = 0.0                       # snapkv@0.5 loses every key P found
    y[:5, 1] = 1 - y[:5, 1]             # recent@0.5 flips five answers
    text = answers_headline(_scored(x, y))
    assert "30 pass-key documents, greedy" in text
    lines = {line.split()[0]: line for line in text.splitlines()[3:]}
    lost = int(x[:, 0].sum())
    assert lines["snapkv@0.5"].endswith(f"{lost}/0") and "(McNemar exact)" in lines["snapkv@0.5"]
    flips = x[:5, 1]
    assert lines["recent@0.5"].endswith(f"{int(flips.sum())}/{int(5 - flips.sum())}")
    assert lines["snapkv@0.3"].endswith("0/0")
    # McNemar's exact p for `lost` discordant pairs all one way: 2 * 0.5**lost
    assert f"{2 * 0.5 ** lost:.2e}" in lines["snapkv@0.5"]


def test_the_demo_collects_and_prints_the_pass_key_set(tmp_path, capsys, monkeypatch):
    """The demo's passkey trace set end to end on tiny:llama (the set made small and opened to it)."""
    import dataclasses

    from service_live import LiveServer

    import protocols
    from kvdiv.demo import run_demo
    from kvdiv.demo_spec import DEMO_STUDY, DemoConfig

    small = dataclasses.replace(DEMO_STUDY.trace_set("passkey"), target_tokens=300, max_new_tokens=6, models=())
    monkeypatch.setattr(DemoConfig, "trace_sets", lambda self: [dataclasses.replace(small, docs=self.passkey_docs)])
    server = LiveServer()
    try:
        cfg = DemoConfig(out=tmp_path / "demo", servers=[server.url], models=["tiny:llama"], docs_count=6,
                         target_tokens=60, replicates=2, max_new_tokens=6, window=5, n_resamples=100, progress=False,
                         passkey_docs=4)
        run_demo(cfg)
    finally:
        server.stop()
    out = capsys.readouterr().out
    assert "does it change the answer? 4 pass-key documents, greedy" in out
    for pol in ("snapkv@0.5", "recent@0.5", "snapkv@0.3", "full"):
        assert f"\n  {pol} " in out
    assert "pass keys: " in out and (tmp_path / "demo" / "passkey" / "report.html").exists()
    ds = protocols.open_traces(tmp_path / "demo" / "passkey.nc")
    assert ds.attrs["kind"] == "coupled" and ds.sizes["doc"] == 4 and "x_score" in ds and "y_text" in ds
    assert list(ds.task.values) == ["passkey"] * 4 and protocols.sampling_params(ds)["temperature"] == 0.0
