"""End to end on the tiny model: the service's residual-branch traces and its plain
coupled traces, run through divstats, estimate the same quantities.

This checks the whole chain (engine → wire → assemble → estimators) against an
independent estimator of the same estimands rather than against earlier output.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

import numpy as np
import pytest

import divstats
from gen_service.engine.facade import Engine
from gen_service.engine.jobs import Sampling, TraceJob
from gen_service.models.loading import load_model
from gen_service.presses.registry import PolicyRegistry
from protocols import StreamWriter, assemble

TEXT = "The quick brown fox jumps over the lazy dog; a lazy dog sleeps under the old tree. " * 3
NAMES = ("occurrence", "rmtd", "exposure", "post_mismatch", "loss")


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(load_model("tiny:llama"), PolicyRegistry())


def traces(engine: Engine, policy: str, kind: str, seed: int, replicates: int, horizon: int,
           sampling: Sampling | None = None):
    prompt = list(engine.lm.tokenizer(TEXT).input_ids)
    job = TraceJob(prompt_ids=prompt, candidate=policy, kind=kind, horizon=horizon,
                   replicates=replicates, seed=seed, doc="d", sampling=sampling or Sampling())
    w = StreamWriter()
    lines = [w.line(r) for r in engine.trace(job)]
    return assemble([*lines, w.end(horizon, replicates, 0.0)])


# Policies whose divergence probability within T is moderate on this prompt (about
# 0.53 and 0.89 for SnapKV and recent; 0.52, 0.52 and 0.55 for the head-wise, per-layer
# and decoding-time mechanisms), so neither estimator's standard error degenerates to 0.
# Head-wise masks, per-layer budgets and decoding-time eviction take the replayed-branch
# path in residual mode, so this also checks that path's estimates.
@pytest.mark.parametrize("policy", ["snapkv@0.9", "recent@0.9", "adakv@0.9", "pyramidkv@0.9",
                                    "kvpress:DecodingPress(KnormPress):compression_interval=3,target_size=248"])
def test_residual_and_coupled_traces_agree(engine: Engine, policy: str) -> None:
    T, R = 6, 256
    crude = divstats.estimate(traces(engine, policy, "coupled", 11, R, T)).isel(doc=0, policy=0)
    resid = divstats.estimate(traces(engine, policy, "residual", 12, R, T)).isel(doc=0, policy=0)
    for name in NAMES:
        diff = float(crude[name] - resid[name])
        se = float(np.hypot(crude[f"{name}_se"], resid[f"{name}_se"]))
        assert se > 0, name
        assert abs(diff) < 4.5 * se, f"{name}: coupled {float(crude[name]):.4f} vs residual " \
                                     f"{float(resid[name]):.4f} (se {se:.4f})"
    # The residual estimator conditions on the survival path: it must not be noisier.
    assert float(resid["loss_se"]) <= float(crude["loss_se"])  # measured ratios 0.54-0.86


def test_forced_replay_agrees_with_coupled(engine: Engine) -> None:
    """The replayed-branch path on a press where the prefix shortcut also holds: same
    estimands as the coupled traces."""
    T, R = 6, 256
    crude = divstats.estimate(traces(engine, "snapkv@0.9", "coupled", 21, R, T)).isel(doc=0, policy=0)
    engine.force_replay = True
    try:
        resid = divstats.estimate(traces(engine, "snapkv@0.9", "residual", 22, R, T)).isel(doc=0, policy=0)
    finally:
        engine.force_replay = False
    for name in NAMES:
        se = float(np.hypot(crude[f"{name}_se"], resid[f"{name}_se"]))
        assert abs(float(crude[name] - resid[name])) < 4.5 * se, name


def test_penalised_replayed_branches_agree_with_coupled(engine: Engine) -> None:
    """History penalties on the replayed-branch path (a decoding-time press): each
    branch row's counts follow its own re-fed history, P and Q separately, so the
    residual estimates are those of the penalised coupled traces. (The estimates are
    not very sensitive to the branch laws on this model; tests/test_service_api_penalties.py
    recomputes each branch age's laws exactly on this path.)"""
    policy = "kvpress:DecodingPress(KnormPress):compression_interval=3,target_size=248"
    sampling = Sampling(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2)
    T, R = 6, 256
    crude = divstats.estimate(traces(engine, policy, "coupled", 31, R, T, sampling)).isel(doc=0, policy=0)
    resid = divstats.estimate(traces(engine, policy, "residual", 32, R, T, sampling)).isel(doc=0, policy=0)
    for name in NAMES:
        se = float(np.hypot(crude[f"{name}_se"], resid[f"{name}_se"]))
        assert se > 0, name
        assert abs(float(crude[name] - resid[name])) < 4.5 * se, f"{name}: coupled {float(crude[name]):.4f} " \
                                                                 f"vs residual {float(resid[name]):.4f} (se {se:.4f})"
