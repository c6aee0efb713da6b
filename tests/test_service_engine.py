"""Batched coupled and residual decoding on the tiny random models."""

from __future__ import annotations

import os

# Before torch loads OpenMP: busy-waiting threads collapse on shared cores (see docs/service.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import pytest
import torch
from scipy import stats

from gen_service.engine.coupling import probs, tv
from gen_service.engine.facade import Engine
from gen_service.engine.jobs import Sampling, TraceJob
from gen_service.engine.readback import READBACK_EVERY
from gen_service.errors import Cancelled, PolicyError
from gen_service.models.loading import load_model
from gen_service.presses.registry import PolicyRegistry
from protocols import assemble

TEXT = "The quick brown fox jumps over the lazy dog; a lazy dog sleeps under the old tree. " * 3


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(load_model("tiny:llama"), PolicyRegistry())


@pytest.fixture(scope="module")
def prompt(engine: Engine) -> list[int]:
    return list(engine.lm.tokenizer(TEXT).input_ids)


def run(engine: Engine, prompt: list[int], **kw) -> list[dict]:
    return list(engine.trace(TraceJob(prompt_ids=prompt, **kw)))


def stream_lines(records: list[dict]) -> list[bytes]:
    from protocols import StreamWriter

    w = StreamWriter()
    return [*(w.line(r) for r in records), w.end(records[0]["horizon"], records[0]["replicates"], 0.1)]


def test_full_vs_full_is_identical(engine: Engine, prompt: list[int]) -> None:
    recs = run(engine, prompt, candidate="full", horizon=6, replicates=4, seed=1)
    for r in recs[1:]:
        assert r["tv"] == [0.0] * 4 and r["x_token"] == r["y_token"]


def test_snapkv_step1_tv_exactly_zero_step2_positive(engine: Engine, prompt: list[int]) -> None:
    recs = run(engine, prompt, candidate="snapkv@0.5", horizon=2, replicates=8, seed=2)
    assert recs[0]["retained_tokens"] == len(prompt) // 2
    assert recs[1]["tv"] == [0.0] * 8
    assert recs[1]["x_token"] == recs[1]["y_token"]
    assert min(recs[2]["tv"]) > 0


def test_streams_assemble_and_validate(engine: Engine, prompt: list[int]) -> None:
    for kind, policy in (("coupled", "snapkv@0.5"), ("residual", "recent@0.5"), ("residual", "snapkv#20"),
                         ("coupled", "streaming@0.5")):
        recs = run(engine, prompt, candidate=policy, kind=kind, horizon=6, replicates=3, seed=3, doc="d")
        ds = assemble(stream_lines(recs))
        assert ds.attrs["kind"] == kind and ds.sizes["replicate"] == 3
    recs = run(engine, prompt, candidate="snapkv@0.5", kind="residual", horizon=8, window=3, replicates=5, seed=4)
    assert all(len(r["tv"]) <= 4 for r in recs if r["type"] == "branch")
    assemble(stream_lines(recs))


def test_seeded_requests_are_reproducible(engine: Engine, prompt: list[int]) -> None:
    def body(seed: int) -> list[dict]:
        recs = run(engine, prompt, candidate="snapkv@0.5", kind="residual", horizon=5, replicates=4, seed=seed)
        return [{k: v for k, v in r.items() if k != "request_id"} for r in recs]

    assert body(11) == body(11)
    assert body(11) != body(12)


def test_step2_mismatch_frequency_matches_tv(engine: Engine, prompt: list[int]) -> None:
    # Row-wise δ differ (they depend on the step-1 token): Σ 1[X≠Y] ~ Poisson-binomial(δ).
    recs = run(engine, prompt, candidate="recent@0.5", horizon=2, replicates=600, seed=5)
    step2 = recs[2]
    d = np.array(step2["tv"])
    mism = np.array(step2["x_token"]) != np.array(step2["y_token"])
    z = (mism.sum() - d.sum()) / np.sqrt((d * (1 - d)).sum())
    assert abs(z) < 3.5, z


def _step2_law(engine: Engine, prompt: list[int], policy: str, sampling: Sampling) -> torch.Tensor:
    """Exact law of the step-2 token under one policy: Σ_v p1(v) p2(· | v)."""
    pre = engine.prefill(engine.registry.resolve(policy), prompt)
    p1 = probs(pre.logits, sampling)[0]
    support = torch.nonzero(p1).flatten()
    pre.cache.batch_repeat_interleave(len(support))
    pos = torch.full((len(support),), len(prompt), dtype=torch.long)
    p2 = probs(engine.step(pre.cache, support, pos), sampling)
    return (p1[support, None] * p2).sum(0)


def test_marginals_match_plain_sampling_chi_square(engine: Engine, prompt: list[int]) -> None:
    sampling = Sampling(top_k=3)
    n = 1500
    recs = run(engine, prompt, candidate="recent@0.5", horizon=2, replicates=n, sampling=sampling, seed=6)
    for side, policy in (("x_token", "full"), ("y_token", "recent@0.5")):
        law = _step2_law(engine, prompt, policy, sampling).double().numpy()
        counts = np.bincount(recs[2][side], minlength=law.size)
        keep = law > 0
        assert counts[~keep].sum() == 0
        expected = law[keep] / law[keep].sum() * n
        assert stats.chisquare(counts[keep], expected).pvalue > 1e-3


def test_residual_branch_state_matches_direct_decoding(engine: Engine, prompt: list[int]) -> None:
    """Age-1 TV of each branch equals TV recomputed from scratch on (z_<t*, X, Y)."""
    recs = run(engine, prompt, candidate="snapkv@0.5", kind="residual", horizon=6, replicates=6, seed=7)
    shared = [r for r in recs if r["type"] == "shared_step"]
    branches = [r for r in recs if r["type"] == "branch"]
    assert branches
    sampling = Sampling()
    for b in branches:
        r, ts = b["replicate"], b["branch_step"]
        assert b["tv"][0] == shared[ts - 1]["tv"][r]
        if len(b["tv"]) < 2:
            continue
        z = [shared[s]["token"][r] for s in range(ts - 1)]
        laws = []
        for policy, first in (("full", b["x_token"][0]), ("snapkv@0.5", b["y_token"][0])):
            pre = engine.prefill(engine.registry.resolve(policy), prompt)
            for k, tok in enumerate([*z, first]):
                logits = engine.step(pre.cache, torch.tensor([tok]), torch.tensor([len(prompt) + k]))
            laws.append(probs(logits, sampling))
        assert tv(*laws).item() == pytest.approx(b["tv"][1], abs=2e-4)


def test_residual_eos_absorbing_and_masks(engine: Engine, prompt: list[int]) -> None:
    # temperature 3 flattens the law so EOS (id 2) shows up within a few steps
    recs = run(engine, prompt, candidate="snapkv#16", kind="residual", horizon=12, replicates=32,
               sampling=Sampling(temperature=3.0), seed=8)
    ds = assemble(stream_lines(recs))
    assert ds.attrs["horizon"] == 12


def test_budget_policy_keeps_short_prompts_whole(engine: Engine) -> None:
    short = list(engine.lm.tokenizer("short prompt").input_ids)
    recs = run(engine, short, candidate="snapkv#512", horizon=2, replicates=2, seed=1)
    head = recs[0]
    assert head["retained_tokens"] == len(short) and "kept whole" in head["candidate"]["note"]
    assert recs[2]["tv"] == [0.0, 0.0]


def test_greedy_is_point_mass(engine: Engine, prompt: list[int]) -> None:
    recs = run(engine, prompt, candidate="snapkv@0.3", horizon=4, replicates=3, sampling=Sampling(do_sample=False),
               seed=1)
    for r in recs[1:]:
        assert len(set(r["x_token"])) == 1 and all(t in (0.0, 1.0) for t in r["tv"])


@pytest.mark.parametrize("every", [1, 8])
def test_cancellation_between_steps(engine: Engine, prompt: list[int], every: int) -> None:
    seen = []

    def cancelled() -> bool:
        return len(seen) >= 3

    engine.readback_every = every     # records come k steps at a time; the flag is read every step
    try:
        with pytest.raises(Cancelled):
            for rec in engine.trace(TraceJob(prompt_ids=prompt, candidate="snapkv@0.5", horizon=50), cancelled):
                seen.append(rec)
    finally:
        engine.readback_every = READBACK_EVERY
    # the header, then step records until the flag is seen: the next step's check stops it
    assert len(seen) == 1 + max(2, every)


def test_policy_registry() -> None:
    reg = PolicyRegistry()
    assert reg.resolve("snapkv@0.5:window_size=8").plan(100).press.window_size == 8
    assert reg.resolve("streaming@0.5").plan(100).press.n_sink == 4
    assert reg.resolve("recent@0.5").plan(100).press.n_sink == 0
    assert reg.resolve("kvpress:TOVAPress@0.5").press_name == "TOVAPress"
    plan = reg.resolve("snapkv#40").plan(100)
    assert plan.expected_kept == 40
    for bad in ("nope@0.5", "snapkv@0", "snapkv@1.5", "snapkv#0", "snapkv@0.5:bogus=1", "kvpress:Nope@0.5",
                "snapkv", "full:x=1"):
        with pytest.raises(PolicyError):
            reg.resolve(bad)


def test_custom_press_registration(engine: Engine, prompt: list[int]) -> None:
    from kvpress import KnormPress

    reg = PolicyRegistry({"knorm": KnormPress}, entry_points_group=None)
    eng = Engine(engine.lm, reg)
    recs = list(eng.trace(TraceJob(prompt_ids=prompt, candidate="knorm@0.5", horizon=2, replicates=2, seed=1)))
    assert recs[0]["candidate"]["press"] == "KnormPress" and recs[1]["tv"] == [0.0, 0.0]


def test_qwen2_tiny_model(prompt: list[int]) -> None:
    eng = Engine(load_model("tiny:qwen2"))
    recs = list(eng.trace(TraceJob(prompt_ids=prompt, candidate="snapkv@0.5", kind="residual", horizon=4,
                                   replicates=3, seed=1)))
    assert recs[1]["tv"] == [0.0] * 3
    assemble(stream_lines(recs))


def test_greedy_residual_paths_stop_at_tv_one(engine: Engine, prompt: list[int]) -> None:
    # Point masses: the first step whose argmaxes differ has TV 1 and ends the path.
    recs = run(engine, prompt, candidate="recent@0.3", kind="residual", horizon=8, replicates=2,
               sampling=Sampling(do_sample=False), seed=1)
    shared = [r for r in recs if r["type"] == "shared_step"]
    stop = next(i for i, r in enumerate(shared) if r["tv"][0] == 1.0)
    assert shared[stop]["token"][0] is None
    assert all(r["tv"][0] is None and r["token"][0] is None for r in shared[stop + 1:])
    branch = next(r for r in recs if r["type"] == "branch" and r["replicate"] == 0)
    assert branch["branch_step"] == stop + 1 and branch["x_token"][0] != branch["y_token"][0]
    assemble(stream_lines(recs))


MECHANISMS = [
    "adakv@0.5",                                                         # head-wise masks
    "kvpress:CriticalAdaKVPress(SnapKVPress)@0.5",
    "kvpress:DMSPress(KnormPress):threshold=-9.0,sliding_window_size=16,decoding=true",
    "pyramidkv@0.5",                                                     # per-layer budgets
    "kvpress:PerLayerCompressionPress(KnormPress):compression_ratios=0.3;0.7",
    "kvpress:DecodingPress(KnormPress):compression_interval=2,target_size=64",  # decoding-time
    "kvpress:PrefillDecodingPress(SnapKVPress@0.5, DecodingPress(KnormPress)#96):compression_interval=2",
    "kvpress:KeyRerotationPress(KnormPress)@0.5",                        # re-rotated positions
    "kvpress:ComposedPress(SnapKVPress@0.5, ThinKPress@0.5)",            # key-channel pruning
    "kvpress:ObservedAttentionPress@0.5",                                # eager attention
    "quant:kivi@2:residual_length=3",                                    # quantized while decoding
    "pyramidkv@0.5+quant:kivi@4:residual_length=3",
]


def _reference_logits(engine: Engine, prompt: list[int], candidate: str, monkeypatch) -> list[torch.Tensor]:
    """Every logit row the reference side produced in a greedy coupled trace."""
    seen: dict = {}
    pair, step = engine.prefill_pair, engine.step

    def spy_pair(*args, **kw):
        p0, q0 = pair(*args, **kw)
        seen.update(side=p0.side, logits=[p0.logits.clone()])
        return p0, q0

    def spy_step(side, *args, **kw):
        out = step(side, *args, **kw)
        if side is seen["side"]:
            seen["logits"].append(out.clone())
        return out

    monkeypatch.setattr(engine, "prefill_pair", spy_pair)
    monkeypatch.setattr(engine, "step", spy_step)
    # P's own forwards: fused with Q's (tests/test_service_fusion.py) they equal these to rounding only
    monkeypatch.setattr(engine, "fuse", "off")
    run(engine, prompt, candidate=candidate, horizon=6, replicates=2, sampling=Sampling(do_sample=False), seed=1)
    monkeypatch.undo()
    return seen["logits"]


def test_full_side_bit_identical_with_any_candidate(engine: Engine, prompt: list[int], monkeypatch) -> None:
    """No state leaks through the shared model: masks, hooks and attention switches of
    the candidate never touch the reference's forwards."""
    base = _reference_logits(engine, prompt, "full", monkeypatch)
    for candidate in MECHANISMS:
        got = _reference_logits(engine, prompt, candidate, monkeypatch)
        assert len(got) == len(base) and all(torch.equal(a, b) for a, b in zip(got, base, strict=True)), candidate


@pytest.mark.parametrize("candidate", MECHANISMS)
def test_mechanisms_in_both_kinds(engine: Engine, prompt: list[int], candidate: str) -> None:
    for kind in ("coupled", "residual"):
        recs = run(engine, prompt, candidate=candidate, kind=kind, horizon=6, replicates=3, seed=3)
        # compression after each layer's prefill: step 1 exact (eager attention, which
        # ObservedAttention needs for its scores, differs from SDPA in the last bits)
        assert max(recs[1]["tv"]) <= (1e-5 if "Observed" in candidate else 0.0)
        assert max(max(r["tv"]) for r in recs[2:] if r["type"] != "branch") > 0
        assemble(stream_lines(recs))
    # nothing left on the shared modules
    assert all(getattr(layer.self_attn, "masked_key_indices", None) is None for layer in engine.model.model.layers)


def test_replayed_branch_state_matches_direct_decoding(engine: Engine, prompt: list[int]) -> None:
    """With a decoding-time press, each branch continues from Q's true state at t*:
    age-2 TV equals TV recomputed by decoding z_<t*, X, Y from scratch under the press."""
    cand = "kvpress:DecodingPress(KnormPress):compression_interval=2,target_size=200"
    recs = run(engine, prompt, candidate=cand, kind="residual", horizon=6, replicates=6, seed=7)
    shared = [r for r in recs if r["type"] == "shared_step"]
    checked = 0
    for b in (r for r in recs if r["type"] == "branch" and len(r["tv"]) >= 2):
        r, ts = b["replicate"], b["branch_step"]
        z = [shared[s]["token"][r] for s in range(ts - 1)]
        laws = []
        for policy, first in (("full", b["x_token"][0]), (cand, b["y_token"][0])):
            pre = engine.prefill(engine.registry.build(policy), prompt)
            for k, tok in enumerate([*z, first]):
                logits = engine.step(pre.side, torch.tensor([tok]), torch.tensor([len(prompt) + k]))
            laws.append(probs(logits, Sampling()))
        assert tv(*laws).item() == pytest.approx(b["tv"][1], abs=2e-4)
        checked += 1
    assert checked


def test_question_is_prefilled_after_compression(engine: Engine, prompt: list[int]) -> None:
    question = list(engine.lm.tokenizer(" Which animal sleeps?").input_ids)
    recs = run(engine, prompt, question_ids=question, candidate="snapkv@0.5", horizon=3, replicates=2, seed=1)
    head = recs[0]
    # only the context is compressed; the question is kept whole after it
    assert head["retained_tokens"] == len(prompt) // 2 + len(question)
    assert head["prompt_tokens"] == len(prompt) + len(question) and head["question_tokens"] == len(question)
    assert max(recs[1]["tv"]) > 0   # the question attends to the compressed context: step 1 differs
    assert head["reference_retained_tokens"] == len(prompt) + len(question)


def test_a_question_fed_token_by_token_makes_logits_once(engine: Engine, prompt: list[int], monkeypatch) -> None:
    """Layers keeping different numbers of slots (pyramidkv) take the question one token at
    a time; only the last token's law is read, so the head runs once (before: once per
    token, most of the question's cost with a 262k vocabulary), and that law is the one
    the model gives after the whole question fed with the head every time."""
    import gen_service.models.float_head as float_head
    from gen_service.engine.prefill import prefill_question

    question = list(engine.lm.tokenizer(" Which animal sleeps in the barn?").input_ids)
    policy = engine.registry.build("pyramidkv@0.5")
    made = [engine.prefill(policy, prompt) for _ in range(2)]
    assert len(set(made[0].kept_slots)) > 1                   # the per-token path
    calls = []
    real = float_head.project
    monkeypatch.setattr(float_head, "project", lambda *a: calls.append(1) or real(*a))
    got = prefill_question(engine.model, made[0].side, question)
    assert len(calls) == 1
    monkeypatch.setattr(float_head, "advance", lambda model, **inputs: float_head.logits(model, 0, **inputs))
    monkeypatch.setattr("gen_service.engine.forwards.advance", float_head.advance)
    want = prefill_question(engine.model, made[1].side, question)
    assert len(calls) == 1 + len(question) and torch.equal(got, want)


def test_question_with_one_forward_prefill_pair(engine: Engine, prompt: list[int]) -> None:
    """The shared prefill (P's full cache kept by hooks during Q's forward) gives both
    sides exactly what their own prefills give, question included: the hooks must not
    see the question's forward, or P would get Q's compressed cache + the question."""
    question = list(engine.lm.tokenizer(" Which animal sleeps?").input_ids)
    full, snap = engine.registry.build("full"), engine.registry.build("snapkv@0.5")
    p0, q0 = engine.prefill_pair(full, snap, prompt, question)
    p1, q1 = engine.prefill(full, prompt, question), engine.prefill(snap, prompt, question)
    for a, b in ((p0, p1), (q0, q1)):
        assert torch.equal(a.logits, b.logits) and a.kept == b.kept and a.kept_slots == b.kept_slots
        assert a.side.next_pos == b.side.next_pos == len(prompt) + len(question)
        assert all(torch.equal(x.keys, y.keys) for x, y in zip(a.cache.layers, b.cache.layers, strict=True))


CAM = "kvpress:CAMPress(KnormPress)#96:compression_interval=2"


@pytest.mark.parametrize("policy", [CAM, "kvpress:DecodingPress(KnormPress):compression_interval=2,target_size=64"])
def test_rows_after_a_question_carry_the_decoding_press_state(engine: Engine, prompt: list[int],
                                                               policy: str) -> None:
    """The question is prefilled at batch 1 with a decoding press's hooks on (CAMPress's
    running attention sum, DecodingPress's hidden-state buffer start there); making R
    rows afterwards must give the state a batch-of-R question prefill gives: the next
    forwards then see the same press state, cache and logits (a CAMPress trace from a
    question with R >= 2 used to fail on the batch-1 running sum)."""
    question = list(engine.lm.tokenizer(" Which animal sleeps?").input_ids)
    policy_ = engine.registry.build(policy)
    after = engine.prefill(policy_, prompt, question).side     # question at batch 1, then rows
    after.rows(2)
    before = engine.prefill(policy_, prompt).side              # rows, then the question at batch 2
    before.rows(2)
    q = torch.tensor([question] * 2)
    engine.forward(before, q, torch.arange(before.next_pos, before.next_pos + len(question))[None].expand(2, -1),
                   logits_to_keep=1)
    before.next_pos += len(question)
    for t, tok in enumerate((5, 7, 11)):   # three steps: CAMPress compresses every second
        tokens, pos = torch.tensor([tok, tok]), torch.full((2,), after.next_pos + t)
        logits = []
        for side in (after, before):
            torch.manual_seed(t)   # CAMPress's merges draw from torch's global generator
            logits.append(engine.step(side, tokens, pos))
        assert torch.equal(*logits)
    for a, b in zip(after.cache.layers, before.cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    sums_a, sums_b = (getattr(s.press, "_running_attn_sum", {}) for s in (after, before))
    assert sums_a.keys() == sums_b.keys() and all(torch.equal(sums_a[k], sums_b[k]) for k in sums_a)


@pytest.mark.parametrize("policy", ["adakv@0.5", "kvpress:KeyRerotationPress(KnormPress)@0.5",
                                    "kvpress:DecodingPress(KnormPress):compression_interval=2,target_size=64"])
def test_generate_follows_the_candidate_kernel(engine: Engine, prompt: list[int], policy: str) -> None:
    """TGI's /generate under an eviction policy decodes the same greedy tokens as the
    candidate side of a trace (same masks, hooks and positions)."""
    greedy = Sampling(do_sample=False)
    gen = [i["id"] for i in engine.generate(prompt, policy, 6, greedy, 0) if "id" in i]
    recs = run(engine, prompt, candidate=policy, horizon=6, replicates=1, sampling=greedy, seed=0)
    ys = [r["y_token"][0] for r in recs[1:]]
    assert gen == ys[:len(gen)]
