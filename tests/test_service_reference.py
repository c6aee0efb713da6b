"""The reference kind on ``/v1/traces`` (gen_service/engine/reference.py): P samples, Q scores.

Every number of a reference record is checked against a direct forward of the tiny
model along the sampled path: log p of the token under P's processed law (penalties
on that path included), log q under Q's compressed cache fed the same tokens, and the
TV between the two laws.
"""

from __future__ import annotations

import os

# Before torch loads OpenMP: busy-waiting threads collapse on shared cores (see docs/service.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import dataclasses
import math

import numpy as np
import pytest
import torch

from gen_service.api.records import parse_trace
from gen_service.engine.coupling import History, probs, tv
from gen_service.engine.facade import Engine
from gen_service.engine.jobs import CandidateDone, Sampling, TraceJob
from gen_service.engine.readback import READBACK_EVERY
from gen_service.errors import Cancelled
from gen_service.models.loading import load_model
from gen_service.serving.limits import RequestLimits
from protocols import StreamWriter, assemble, validate

TEXT = "The quick brown fox jumps over the lazy dog; a lazy dog sleeps under the old tree. " * 3
DECODING = "kvpress:DecodingPress(KnormPress):compression_interval=2,target_size=32"


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(load_model("tiny:llama"))


@pytest.fixture(scope="module")
def prompt(engine: Engine) -> list[int]:
    return list(engine.lm.tokenizer(TEXT).input_ids)


def run(engine: Engine, prompt: list[int], **kw) -> list[dict]:
    return list(engine.trace(TraceJob(prompt_ids=prompt, kind="reference", **kw)))


def lines(records: list[dict]) -> list[bytes]:
    w = StreamWriter()
    return [*(w.line(r) for r in records), w.end(records[0]["horizon"], records[0]["replicates"], 0.1)]


def steps(records: list[dict], key: str) -> np.ndarray:
    """(replicate, step) array of one field of the reference-step records (null -> NaN)."""
    rows = [[math.nan if v is None else v for v in r[key]] for r in records if r["type"] == "reference_step"]
    return np.array(rows, dtype=float).T


def test_stream_header_and_pack_to_a_reference_dataset(engine: Engine, prompt: list[int]) -> None:
    recs = run(engine, prompt, candidate="snapkv@0.5", horizon=6, replicates=4, seed=1, doc="d")
    head = recs[0]
    assert head["kind"] == "reference" and head["window"] == 0 and head["retained_tokens"] == len(prompt) // 2
    assert [r["type"] for r in recs[1:]] == ["reference_step"] * 6
    ds = validate(assemble(lines(recs)))
    assert ds.attrs["kind"] == "reference" and ds.attrs["window"] == 0
    assert set(ds.data_vars) == {"x_token", "x_logp", "x_logq", "tv"}
    np.testing.assert_array_equal(ds.x_token.values[0, 0], steps(recs, "x_token"))
    # Q's compressed cache gives laws of its own along P's path
    assert float(ds.tv.max()) > 0 and (ds.x_logp.values <= 0).all()


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(top_k=5, temperature=0.8, repetition_penalty=1.3)])
def test_logp_and_logq_match_a_direct_forward_on_the_sampled_path(engine: Engine, prompt: list[int],
                                                                  sampling: Sampling) -> None:
    """log p, log q and TV of each step equal P's and Q's processed laws recomputed from
    scratch on x_<t (one prefill per policy, then the path fed one token at a time), the
    history penalties counting the prompt and that path for both sides."""
    T, R = 5, 3
    recs = run(engine, prompt, candidate="recent@0.5", horizon=T, replicates=R, sampling=sampling, seed=3)
    x, lp, lq, d = (steps(recs, k) for k in ("x_token", "x_logp", "x_logq", "tv"))
    for r in range(R):
        laws = []
        for policy in ("full", "recent@0.5"):
            pre = engine.prefill(engine.registry.resolve(policy), prompt)
            logits, hist, out = pre.logits, History.start(prompt, 1, pre.logits.shape[-1]), []
            for t in range(T):
                out.append(probs(logits, sampling, hist if sampling.uses_history else None)[0])
                tok = torch.tensor([int(x[r, t])])
                hist = hist.add(tok)
                logits = engine.step(pre.cache, tok, torch.tensor([len(prompt) + t]))
            laws.append(out)
        for t in range(T):
            p, q = laws[0][t], laws[1][t]
            tok = int(x[r, t])
            assert lp[r, t] == pytest.approx(math.log(p[tok]), abs=2e-4)
            want_q = math.log(q[tok]) if q[tok] > 0 else -math.inf
            assert (np.isnan(lq[r, t]) and want_q == -math.inf) or lq[r, t] == pytest.approx(want_q, abs=2e-4)
            assert d[r, t] == pytest.approx(tv(p[None], q[None]).item(), abs=2e-4)


def test_control_scores_every_token_as_p_does(engine: Engine, prompt: list[int]) -> None:
    recs = run(engine, prompt, candidate="full", horizon=5, replicates=4, seed=4)
    assert (steps(recs, "tv") == 0).all()
    np.testing.assert_array_equal(steps(recs, "x_logp"), steps(recs, "x_logq"))


def test_tokens_follow_p_alone(engine: Engine, prompt: list[int]) -> None:
    """P's path does not depend on the candidate: the same seed gives the same tokens and
    the same log p whatever Q is (Q is only asked to score)."""
    a = run(engine, prompt, candidate="snapkv@0.3", horizon=5, replicates=4, seed=5)
    b = run(engine, prompt, candidate="full", horizon=5, replicates=4, seed=5)
    np.testing.assert_array_equal(steps(a, "x_token"), steps(b, "x_token"))
    np.testing.assert_allclose(steps(a, "x_logp"), steps(b, "x_logp"), atol=1e-5)


def test_multi_candidate_equals_one_request_per_candidate(engine: Engine, prompt: list[int]) -> None:
    """Candidates (with the control and a press acting while decoding, which compresses
    along P's path) in one request give each its own request's records, bit for bit with
    every forward alone."""
    cands, seeds = ["snapkv@0.5", DECODING, "full"], [7, 8, 9]
    engine.batch_candidates = False
    engine.fuse = "off"   # each forward alone, in both requests
    try:
        items = list(engine.trace(TraceJob(prompt_ids=prompt, candidate="", kind="reference", horizon=6,
                                           replicates=3, candidates=cands, seeds=seeds, request_id="r")))
        alone = {policy: run(engine, prompt, candidate=policy, horizon=6, replicates=3, seed=seed, request_id="r")
                 for policy, seed in zip(cands, seeds, strict=True)}
    finally:
        engine.batch_candidates, engine.fuse = True, "auto"
    done = [i.policy for i in items if isinstance(i, CandidateDone)]
    assert sorted(done) == sorted(cands)
    for policy in cands:
        mine = [dict(i) for i in items if isinstance(i, dict) and
                (i["candidate"]["policy"] if i["type"] == "header" else i["candidate"]) == policy]
        for rec in mine[1:]:
            rec.pop("candidate")
        assert mine[1:] == alone[policy][1:]
        validate(assemble(lines(mine), doc="d"))
    decoding = [i for i in items if isinstance(i, dict) and i.get("candidate") == DECODING]
    assert max(max(r["tv"]) for r in decoding) > 0


def test_several_eos_ids_are_absorbing(engine: Engine, prompt: list[int]) -> None:
    """With two EOS ids (the two likeliest first tokens, so many rows end at once) a row
    keeps the id it ended on; from the next step both laws are its point mass."""
    first = probs(engine.prefill(engine.registry.resolve("full"), prompt).logits, Sampling())[0]
    eos = tuple(int(i) for i in first.topk(2).indices)
    lm = dataclasses.replace(engine.lm, eos_token_id=eos[0], eos_token_ids=eos)
    recs = list(Engine(lm).trace(TraceJob(prompt_ids=prompt, candidate="snapkv@0.5", kind="reference", horizon=6,
                                          replicates=48, sampling=Sampling(temperature=2.0), seed=10, doc="d")))
    assert recs[0]["eos_token_ids"] == list(eos)
    x, lp, lq, d = (steps(recs, k) for k in ("x_token", "x_logp", "x_logq", "tv"))
    ended = set()
    for r in range(x.shape[0]):
        hits = np.flatnonzero(np.isin(x[r], eos))
        if hits.size:
            k = hits[0]
            ended.add(int(x[r, k]))
            assert (x[r, k:] == x[r, k]).all()
            assert (lp[r, k + 1:] == 0).all() and (lq[r, k + 1:] == 0).all() and (d[r, k + 1:] == 0).all()
    assert ended == set(eos)
    validate(assemble(lines(recs)))


@pytest.mark.parametrize("every", [1, 8])
def test_cancellation_between_steps(engine: Engine, prompt: list[int], every: int) -> None:
    seen: list[dict] = []
    engine.readback_every = every     # records come k steps at a time; the flag is read every step
    try:
        with pytest.raises(Cancelled):
            job = TraceJob(prompt_ids=prompt, candidate="snapkv@0.5", kind="reference", horizon=50)
            for rec in engine.trace(job, lambda: len(seen) >= 3):
                seen.append(rec)
    finally:
        engine.readback_every = READBACK_EVERY
    # the header, then step records until the flag is seen: the next step's check stops it
    assert len(seen) == 1 + max(2, every)


def test_request_parsing() -> None:
    from gen_service.errors import ApiError

    req = parse_trace({"inputs": "Hi", "candidate": "snapkv@0.5", "kind": "reference"}, RequestLimits())
    assert req.job.kind == "reference" and req.job.window is None
    with pytest.raises(ApiError, match="window"):
        parse_trace({"inputs": "Hi", "candidate": "snapkv@0.5", "kind": "reference", "window": 4}, RequestLimits())


def test_memory_gate_sizes_reference_as_coupled(engine: Engine) -> None:
    from gen_service.serving.admission import ModelShape, estimate

    s = ModelShape(layers=30, q_heads=9, kv_heads=3, head_dim=64, hidden=576, intermediate=1536, vocab=49152)
    assert estimate(s, 16, 500, 32, "reference") == estimate(s, 16, 500, 32, "coupled")
