"""The intake (gen_service/serving/intake.py): one place for a request's checks, policies built once."""

from __future__ import annotations

import collections
import math
import subprocess
import sys
import time

import httpx
import pytest
from service_live import PROMPT, LiveServer

from gen_service.engine.jobs import TraceJob
from gen_service.errors import ApiError
from gen_service.presses.registry import ModelInfo, PolicyRegistry
from gen_service.serving.admission import MemoryGate, ModelShape
from gen_service.serving.intake import Intake, Message, StepCost, TraceRequest, request_seconds_limit, row_steps

PROBE = """
import sys
from gen_service.api.records import parse_trace
from gen_service.serving.intake import Intake, StepCost
from gen_service.serving.limits import RequestLimits
req = parse_trace({"inputs": "Hi", "candidates": ["snapkv@0.5", "full"], "parameters": {"temperature": 0.7}},
                  RequestLimits())
assert req.job.sampling.temperature == 0.7 and req.job.policy_ids == ("snapkv@0.5", "full")
print("HEAVY=" + ",".join(sorted(m for m in ("torch", "transformers", "kvpress") if m in sys.modules)))
"""


def test_parsing_a_request_and_the_intake_import_no_torch() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("HEAVY=")]
    assert line == ["HEAVY="], out.stdout + out.stderr


class _Encoder:
    """Tokens by word count: what the intake asks of the service."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(range(1, len(text.split()) + 1))

    def encode_chat(self, messages: tuple[Message, ...]) -> list[int]:
        return self.encode(" ".join(m.content for m in messages))

    def encode_context(self, context: str, question: str = "") -> tuple[list[int], list[int]]:
        return self.encode(context), self.encode(question)


SHAPE = ModelShape(layers=2, q_heads=4, kv_heads=2, head_dim=16, hidden=64, intermediate=128, vocab=320)


def _intake(budget: int = 1 << 30, seconds: float | None = 600.0, per_step: float = 1e-3) -> Intake:
    return Intake(PolicyRegistry(entry_points_group=None), ModelInfo(max_context=256, num_layers=2), vocab_size=320,
                  max_context=256, memory=MemoryGate(SHAPE, budget), cost=StepCost(per_step), max_seconds=seconds)


def _request(**kw) -> TraceRequest:
    return TraceRequest(TraceJob(prompt_ids=[], **{"candidate": "full", **kw}), inputs="one two three four")


def _refused(intake: Intake, request: TraceRequest) -> str:
    with pytest.raises(ApiError) as err:
        intake.admit(request, _Encoder())
    assert err.value.status == 422
    return err.value.message


def test_admit_tokenises_builds_and_sizes_once() -> None:
    job = _intake().admit(_request(candidates=["full", "quant:kivi@2"], replicates=4, horizon=8), _Encoder())
    trace = job.trace
    assert trace.prompt_ids == [1, 2, 3, 4] and trace.policies is not None
    assert [b.id for b in trace.policies.candidates] == ["full", "quant:kivi@2"]
    # the full control and the reference are one id: built once, one object
    assert trace.policies.reference is trace.policies.candidates[0]
    assert job.row_steps == 4 * 8 * 2 and job.seconds == pytest.approx(64 * 1e-3)
    assert job.memory.rows == 4 and job.memory.sides is not None and len(job.memory.sides) == 2


def test_every_refusal_names_its_field_in_one_order() -> None:
    intake = _intake()
    assert _refused(intake, _request(horizon=300)).startswith("inputs: prompt of 4 tokens + 300 new tokens exceeds")
    assert _refused(intake, _request(candidates=["full", "nope@0.5"])).startswith("candidates[1]: ")
    assert _refused(intake, _request(reference="quant:kivi@3")).startswith("reference: ")
    # the context comes first, then the policies, then the vocabulary
    assert _refused(intake, _request(horizon=300, candidate="nope@0.5")).startswith("inputs: ")
    assert _refused(intake, _request(candidate="nope@0.5", top_logprobs=400)).startswith("candidate: ")
    assert _refused(intake, _request(top_logprobs=400)) == "top_logprobs: must be <= the vocabulary size 320"
    assert _refused(_intake(budget=1 << 10), _request(replicates=64)).startswith("replicates: needs an estimated")


def test_time_refusal_says_the_estimate_and_the_limit() -> None:
    intake = _intake(seconds=10.0, per_step=1e-3)
    ok = intake.admit(_request(replicates=8, horizon=100), _Encoder())   # 800 row-steps: 0.8 s
    assert ok.seconds == pytest.approx(0.8)
    msg = _refused(intake, _request(replicates=200, horizon=100, kind="residual"))
    assert msg.startswith("replicates: needs an estimated 40 s (40000 row-steps: R=200 x T=100 x 2 for the "
                          "branches, at 1 ms per row-step, a prior of 1 ms from the model's size: nothing timed "
                          "yet)")
    assert "the limit is --max-request-seconds 10 s: at most R=50 fits at this T" in msg and "do not retry" in msg
    # the server's own work (the self-check) is not held to a client's limit
    big = TraceJob(prompt_ids=[1, 2, 3], candidate="full", replicates=200, horizon=100)
    assert intake.admit_job(big, own=True).seconds == pytest.approx(20.0)
    # no limit: nothing refused for time
    assert _intake(seconds=None).admit(_request(replicates=200, horizon=100), _Encoder()).seconds > 10


def test_step_cost_moves_from_its_prior_by_each_request_s_size() -> None:
    cost = StepCost(prior=1.0, scale=100)
    cost.observe(seconds=1.0, steps=0)      # nothing decoded (cancelled in prefill): no measurement
    assert cost.seconds == 1.0 and cost.measured == 0
    cost.observe(seconds=2.0, steps=100)    # 0.02 s per row-step, weight 1 - 1/e
    w = 1 - math.exp(-1)
    assert cost.seconds == pytest.approx((1 - w) * 1.0 + w * 0.02)
    before = cost.seconds
    cost.observe(seconds=0.004, steps=1)    # a tiny request hardly moves it
    assert cost.seconds == pytest.approx(before * math.exp(-0.01) + (1 - math.exp(-0.01)) * 0.004)
    cost.observe(seconds=40.0, steps=2000)  # a large one sets it
    assert cost.seconds == pytest.approx(0.02, rel=1e-6) and cost.measured == 3
    assert row_steps({"type": "step"}, 8) == row_steps({"type": "reference_step"}, 8) == 8
    assert row_steps({"type": "branch", "tv": [0.0] * 4}, 8) == 3 and row_steps({"type": "header"}, 8) == 0
    assert request_seconds_limit(None, "cpu") == 600.0 and request_seconds_limit(None, "cuda") is None


def test_a_grouped_request_builds_each_policy_exactly_once() -> None:
    """Before the intake each policy was built three times per request (checked, sized, run)."""
    s = LiveServer()
    counts: collections.Counter[str] = collections.Counter()
    build = s.service.engine.registry.build

    def counted(policy_id: str, info: ModelInfo | None = None):
        counts[policy_id] += 1
        return build(policy_id, info)

    s.service.engine.registry.build = counted   # type: ignore[method-assign]
    measured = s.service.step_cost.measured     # the start-up self-check's requests
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            r = c.post("/v1/traces", json={"inputs": PROMPT, "candidates": ["snapkv@0.5", "recent@0.5", "full"],
                                           "replicates": 2, "parameters": {"max_new_tokens": 4}})
            assert r.status_code == 200 and r.text.count('"type":"end"') == 3
        assert counts == {"snapkv@0.5": 1, "recent@0.5": 1, "full": 1}
        assert s.service.step_cost.measured == measured + 1   # and its time measured the step cost
    finally:
        s.stop()


def test_a_trace_s_pages_go_back_to_the_os_when_its_work_ends(monkeypatch) -> None:
    """A cancelled request of R = 128 left the CPU server's RSS +37 % above before; collecting
    and trimming the heap once its caches are garbage brings it back (docs/service.md, "The intake")."""
    import gen_service.serving.service as service_module
    from gen_service.errors import Cancelled

    trims: list[int] = []
    monkeypatch.setattr(service_module, "return_freed_memory", lambda: trims.append(1) or True)
    s = LiveServer()
    body = {"inputs": PROMPT, "candidate": "snapkv@0.5", "replicates": 2, "parameters": {"max_new_tokens": 3}}
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.post("/v1/traces", json=body).status_code == 200
            time.sleep(0.5)
            assert trims == []      # a small request: a full collection would cost more than it frees
            monkeypatch.setattr(service_module, "TRIM_BYTES", 0)   # as if it were large
            assert c.post("/v1/traces", json=body).status_code == 200
            for _ in range(100):
                if trims:
                    break
                time.sleep(0.05)
            assert trims == [1]
            c.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
            assert trims == [1]     # plain generations: no trim
    finally:
        s.stop()
    # a stop's traceback, which would hold the engine's frames and their caches, is not forwarded
    got: list = []

    class _Stream(service_module.WorkStream):
        def __init__(self) -> None:   # only what end() reads
            self.began, self.meter, self.cancel, self.trim = None, None, __import__("threading").Event(), False
            self.deadline, self._ticket = None, type("T", (), {"release": lambda self, c: None})()

        def _put(self, kind, value) -> None:
            got.append(value)

    try:
        raise Cancelled()
    except Cancelled as exc:
        assert exc.__traceback__ is not None
        _Stream().end(exc)
    assert got[0].__traceback__ is None
