"""A failure stays in its request: NaN or inf logits in one request's rows end that
request with an error naming the step, after the records of the steps before it; its
batch-mates finish unchanged (gen_service/engine/readback.py's FiniteGuard, read back
with the records, never a host sync of its own).

Injected: the engine's forwards (``gen_service.engine.forwards.fp32_logits``) poison
one row of the forward at one position, which only one request of the batch reaches.
On CPU, and (marked ``gpu``) the same on CUDA, where sampling a NaN row would be a
device-side assert that ends every request of the process."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from typing import Any

import pytest
import torch
from test_service_batching import JOBS, Stream, _batch, _job

import gen_service.engine.forwards as forwards
from gen_service.api.handlers import stream_error
from gen_service.engine.facade import Engine
from gen_service.engine.jobs import CandidateDone, CandidateFailed, Sampling
from gen_service.engine.readback import FiniteGuard, HostReads, Readback
from gen_service.errors import NonFiniteLogits
from gen_service.models.loading import load_model

BAD_STEP = 6   # the step whose logits are poisoned (> 1: earlier steps' records come out first)


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny:llama")


def _poison(monkeypatch: pytest.MonkeyPatch, position: int, value: float) -> None:
    """Every decoding forward as before, but the first row fed at ``position`` gets one
    logit ``value``."""
    real = forwards.fp32_logits

    def poisoned(model: torch.nn.Module, keep: int = 0, **inputs: Any) -> torch.Tensor:
        out = real(model, keep, **inputs)
        hit = (inputs["position_ids"][:, -1] == position).nonzero()
        if len(hit):
            out[hit[0, 0], -1, 7] = value
        return out

    monkeypatch.setattr(forwards, "fp32_logits", poisoned)


def _alone(lm: Any, job: Any) -> list[Any]:
    engine = Engine(lm)
    engine.fuse = "off"
    return list(engine.trace(job))


def _assert_same(a: list[Any], b: list[Any], tol: float = 1e-5) -> None:
    """Records equal, floats (TV, log-probabilities) to the batch's rounding."""
    assert len(a) == len(b)
    for ra, rb in zip(a, b, strict=True):
        if not isinstance(ra, dict) or ra["type"] == "header":
            assert ra == rb
            continue
        assert ra.keys() == rb.keys()
        for key, va in ra.items():
            if isinstance(va, list) and any(isinstance(x, float) for x in va):
                assert all((x is None and y is None) or x == y or abs(x - y) <= tol
                           for x, y in zip(va, rb[key], strict=True)), key
            else:
                assert va == rb[key], key


def _of(items: list[Any], policy: str) -> list[dict[str, Any]]:
    """One candidate's records of a multi-candidate request."""
    return [r for r in items if isinstance(r, dict) and (r["candidate"]["policy"] if r["type"] == "header"
                                                         else r["candidate"]) == policy]


@pytest.mark.parametrize("kind,value", [("coupled", float("nan")), ("residual", float("inf")),
                                        ("reference", float("-inf"))])
def test_non_finite_logits_end_their_request_only(lm, kind, value, monkeypatch):
    jobs = [_job(kind=kind, **j) for j in JOBS]
    victim = 1                                    # its prompt (60 tokens) is the only one whose rows reach
    position = 60 + BAD_STEP - 2                  # this position: the forward giving step BAD_STEP's logits
    alone = [_alone(lm, job) for job in jobs]
    _poison(monkeypatch, position, value)
    engine = Engine(lm)
    engine.fuse = "off"
    streams, _ = _batch(engine, jobs)
    err = streams[victim].ended[0]
    assert isinstance(err, NonFiniteLogits), err
    assert err.step == f"step {BAD_STEP}" and err.rows == 1 and err.of == jobs[victim].replicates
    assert f"at step {BAD_STEP} " in str(err)
    # the header and every step before the bad one, as alone; nothing from it on
    want = [r for r in alone[victim] if r["type"] == "header" or r["type"] != "branch" and r["step"] < BAD_STEP]
    _assert_same(streams[victim].items, want)
    for i, stream in enumerate(streams):
        if i != victim:
            assert stream.ended == [None]
            _assert_same(stream.items, alone[i])
    # the error record a client gets names the step
    rec = stream_error(err)
    assert rec["error_type"] == "non_finite_logits" and f"step {BAD_STEP}" in rec["error"]


def test_a_candidate_with_non_finite_logits_ends_alone(lm, monkeypatch):
    """A multi-candidate request: the candidate whose row is poisoned fails, the others finish as alone."""
    job = _job(**JOBS[2])                          # 80-token prompt, three candidates
    alone = _alone(lm, job)
    _poison(monkeypatch, 80 + BAD_STEP - 2, float("nan"))
    engine = Engine(lm)
    engine.fuse = "off"
    (stream,), _ = _batch(engine, [job])
    assert stream.ended == [None]
    failed = [i for i in stream.items if isinstance(i, CandidateFailed)]
    done = {i.policy for i in stream.items if isinstance(i, CandidateDone)}
    assert len(failed) == 1 and isinstance(failed[0].error, NonFiniteLogits)
    assert failed[0].error.step == f"step {BAD_STEP}"
    assert done == set(job.candidates) - {failed[0].policy}
    for policy in done:
        _assert_same(_of(stream.items, policy), _of(alone, policy))


def test_a_branch_step_with_non_finite_logits_is_named(lm, monkeypatch):
    """Residual branches run after the survival path: a poisoned branch forward ends the
    request before any branch record, naming the branch step."""
    job = _job(kind="residual", **JOBS[1])
    records = _alone(lm, job)
    branches = [r for r in records if r["type"] == "branch"]
    assert branches
    seen = []
    real = forwards.fp32_logits

    def poisoned(model: torch.nn.Module, keep: int = 0, **inputs: Any) -> torch.Tensor:
        out = real(model, keep, **inputs)
        seen.append(1)
        if len(seen) > 2 * job.horizon:           # past the survival path's forwards: a branch's
            out[0, -1, 3] = float("nan")
        return out

    monkeypatch.setattr(forwards, "fp32_logits", poisoned)
    engine = Engine(lm)
    engine.fuse = "off"
    (stream,), _ = _batch(engine, [job])
    err = stream.ended[0]
    assert isinstance(err, NonFiniteLogits) and err.step.startswith("branch") and err.t is None
    assert not any(isinstance(r, dict) and r["type"] == "branch" for r in stream.items)
    assert [r for r in stream.items if r["type"] == "shared_step"] == [r for r in records
                                                                      if r["type"] == "shared_step"]


def test_the_guard_rides_in_the_readback_copy():
    """No host read of its own: k steps, one copy, records before the bad step, then the error."""
    guard = FiniteGuard(torch.device("cpu"))
    rb = Readback(4, lambda t, v: (t, v), guard)
    good = torch.zeros(3, 5)
    out: list[Any] = []
    with HostReads([os.path.dirname(forwards.__file__)]) as reads:
        for t in range(1, 5):
            bad = good.clone()
            if t == 3:
                bad[2, 1] = float("inf")
            lp, lq = guard(t, f"step {t}", bad, good)
            assert torch.isfinite(lp).all() and torch.equal(lq, good)   # the bad row is zeros: a uniform law
            try:
                out.extend(rb.emit(t, lp.sum(-1)))
            except NonFiniteLogits as exc:
                err = exc
                break
    assert reads.count == 1
    assert [t for t, _ in out] == [1, 2]
    assert err.t == 3 and err.side == "P" and (err.rows, err.of) == (1, 3)


def test_generate_refuses_non_finite_logits(lm, monkeypatch):
    """TGI's plain sampling: an error naming the token instead of sampling a NaN row."""
    engine = Engine(lm)
    step = engine.step

    def poisoned(side, tok, pos):
        out = step(side, tok, pos)
        return torch.full_like(out, float("nan"))

    monkeypatch.setattr(engine, "step", poisoned)
    it = engine.generate(list(range(10, 40)), "full", 5, Sampling(), seed=1)
    assert "finish_reason" not in next(it)        # the first token, from the prefill's finite logits
    with pytest.raises(NonFiniteLogits, match="token 2"):
        list(it)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_nan_row_ends_its_request_without_a_device_assert(monkeypatch):
    """The same injection on CUDA in bf16: without the guard ``torch.multinomial`` would
    assert on the device and every request of the process would end."""
    cuda = load_model("tiny:llama", device="cuda", dtype="bfloat16")
    jobs = [_job(kind="coupled", **j) for j in JOBS[:4]]
    _poison(monkeypatch, 60 + BAD_STEP - 2, float("nan"))
    engine = Engine(cuda)
    engine.fuse = "off"
    streams = [Stream() for _ in jobs]
    _batch(engine, jobs, streams)
    assert isinstance(streams[1].ended[0], NonFiniteLogits) and streams[1].ended[0].step == f"step {BAD_STEP}"
    assert all(s.ended == [None] for i, s in enumerate(streams) if i != 1)
    torch.cuda.synchronize()   # no device-side assert pending
