"""History penalties in traces: each side's law is recomputed from scratch on its own
history (prompt + its tokens) and must equal what the batched engine coupled."""

from __future__ import annotations

import os

# Before torch loads OpenMP: busy-waiting threads collapse on shared cores (see docs/service.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

from gen_service.engine.coupling import History, probs, tv
from gen_service.engine.facade import Engine
from gen_service.engine.jobs import Sampling, TraceJob
from gen_service.models.loading import load_model
from gen_service.presses.registry import PolicyRegistry

TEXT = "The quick brown fox jumps over the lazy dog; a lazy dog sleeps under the old tree. " * 3
PENALTIES = Sampling(repetition_penalty=3.0, frequency_penalty=0.8, presence_penalty=0.5)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(load_model("tiny:llama"), PolicyRegistry())


@pytest.fixture(scope="module")
def prompt(engine: Engine) -> list[int]:
    return list(engine.lm.tokenizer(TEXT).input_ids)


def law(engine: Engine, prompt: list[int], policy: str, tokens: list[int], sampling: Sampling,
        question: list[int] = ()) -> torch.Tensor:
    """The sampling law after ``prompt + question + tokens`` under ``policy``, penalised by
    that history: one row, decoded token by token from a fresh prefill (a decoding-time
    press compresses at the same steps as on any path that fed the same tokens)."""
    pre = engine.prefill(engine.registry.build(policy), prompt, list(question))
    logits = pre.logits
    for k, tok in enumerate(tokens):
        logits = engine.step(pre.side, torch.tensor([tok]), torch.tensor([pre.side.next_pos + k]))
    history = History.start([*prompt, *question, *tokens], 1, logits.shape[-1])
    return probs(logits, sampling, history)


def test_coupled_sides_are_penalised_by_their_own_histories(engine: Engine, prompt: list[int]) -> None:
    recs = list(engine.trace(TraceJob(prompt_ids=prompt, candidate="recent@0.3", horizon=4, replicates=4,
                                      sampling=PENALTIES, seed=3)))
    steps = [r for r in recs if r["type"] == "step"]
    assert recs[0]["sampling"]["repetition_penalty"] == 3.0
    for r in range(4):
        xs, ys = [s["x_token"][r] for s in steps], [s["y_token"][r] for s in steps]
        for t in (1, 3):
            p = law(engine, prompt, "full", xs[:t], PENALTIES)
            q = law(engine, prompt, "recent@0.3", ys[:t], PENALTIES)
            assert tv(p, q).item() == pytest.approx(steps[t]["tv"][r], abs=2e-4)


def test_question_counts_in_the_history(engine: Engine, prompt: list[int]) -> None:
    """With context + question, the penalised history is context + question + tokens."""
    question = list(engine.lm.tokenizer("Who sleeps? The dog sleeps.", add_special_tokens=False).input_ids)
    recs = list(engine.trace(TraceJob(prompt_ids=prompt, question_ids=question, candidate="snapkv@0.5",
                                      horizon=3, replicates=3, sampling=PENALTIES, seed=5)))
    steps = [r for r in recs if r["type"] == "step"]
    for r in range(3):
        xs, ys = [s["x_token"][r] for s in steps], [s["y_token"][r] for s in steps]
        for t in (0, 2):
            p = law(engine, prompt, "full", xs[:t], PENALTIES, question)
            q = law(engine, prompt, "snapkv@0.5", ys[:t], PENALTIES, question)
            assert tv(p, q).item() == pytest.approx(steps[t]["tv"][r], abs=2e-4)


DECODING = "kvpress:DecodingPress(KnormPress):compression_interval=2,target_size=200"


# snapkv@0.5 takes the prefix path; forced, the replayed path; a decoding-time press
# (compressing every 2 steps while decoding) always replays its branches.
@pytest.mark.parametrize("policy, force_replay", [("snapkv@0.5", False), ("snapkv@0.5", True), (DECODING, False)])
def test_residual_branches_continue_from_their_own_histories(engine: Engine, prompt: list[int], policy: str,
                                                             force_replay: bool) -> None:
    engine.force_replay = force_replay
    try:
        recs = list(engine.trace(TraceJob(prompt_ids=prompt, candidate=policy, kind="residual", horizon=6,
                                          replicates=6, sampling=PENALTIES, seed=7)))
    finally:
        engine.force_replay = False
    shared = [r for r in recs if r["type"] == "shared_step"]
    branches = [r for r in recs if r["type"] == "branch" and len(r["tv"]) >= 2]
    assert branches
    gaps = []
    for b in branches:
        r, ts = b["replicate"], b["branch_step"]
        z = [shared[s]["token"][r] for s in range(ts - 1)]
        xs, ys = b["x_token"], b["y_token"]
        for age in range(1, len(b["tv"])):  # each age's laws, after each side's own branch so far
            p = law(engine, prompt, "full", [*z, *xs[:age]], PENALTIES)
            q = law(engine, prompt, policy, [*z, *ys[:age]], PENALTIES)
            assert tv(p, q).item() == pytest.approx(b["tv"][age], abs=2e-4), (r, ts, age)
        plain = tv(law(engine, prompt, "full", [*z, xs[0]], Sampling()),
                   law(engine, prompt, policy, [*z, ys[0]], Sampling())).item()
        gaps.append(abs(plain - b["tv"][1]))
    assert max(gaps) > 0.01  # the penalties matter: without them the age-2 laws are other ones
