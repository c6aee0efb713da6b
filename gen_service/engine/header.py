"""A trace's header record: what was asked, what the policies did to the prompt."""

from __future__ import annotations

from typing import Any

from gen_service.engine.jobs import PRODUCER, Built, TraceJob
from gen_service.engine.sides import Prefilled
from gen_service.models.loading import LoadedModel
from gen_service.presses.registry import Policy
from protocols import Kind, header_record, prompt_digest

__all__ = ["compression", "header", "numerics"]


def numerics(lm: LoadedModel, fuse: str | None) -> dict[str, Any]:
    """The header's numerics fields: weights dtype, device type, fusion mode and whether P+Q are fused.

    ``fused`` is known before decoding only when the mode fixes it (``on`` / ``off``);
    under ``auto`` it is decided per step shape by timing, after the header, and is left out.
    """
    out: dict[str, Any] = {"dtype": str(lm.dtype).removeprefix("torch."), "device": lm.device.type}
    if fuse is not None:
        out["fuse"] = str(fuse)
        if fuse in ("on", "off"):
            out["fused"] = fuse == "on"
    return out


def compression(p0: Prefilled, q0: Prefilled) -> dict[str, Any]:
    """Which layers Q's policy compressed (fewer visible slots than P's) and the share of
    P's cache it kept over every layer (``cache_retention``, slots summed over layers)."""
    p, q = p0.kept_layers, q0.kept_layers
    if not p or len(p) != len(q):
        return {}
    return {"compressed_layers": [i for i, (a, b) in enumerate(zip(p, q, strict=True)) if b < a],
            "cache_retention": round(sum(q) / sum(p), 6) if sum(p) > 0 else 1.0}


def header(lm: LoadedModel, job: TraceJob, seed: int, cand: Policy | Built, ref: Policy | Built, p0: Prefilled,
           q0: Prefilled, fuse: str | None = None, attention: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``header`` record of one candidate's stream (``kvdiv.trace/1``); ``fuse`` is the server's
    P+Q fusion mode (recorded with the numerics); ``attention`` the model's attention plan
    (gen_service.attention.plan, its ``header()``)."""
    candidate = cand.describe()
    candidate.update(params=q0.plan.params, note=q0.plan.note)
    reference = ref.describe()
    nq = len(job.question_ids)
    extra: dict[str, Any] = {"question_tokens": nq} if nq else {}
    if job.top_logprobs:   # k of the records' logits objects (docs/contract.md §3)
        extra["top_logprobs"] = job.top_logprobs
    extra.update(compression(p0, q0))
    if attention is not None:
        extra["attention"] = attention
    return header_record(
        kind=job.kind, horizon=job.horizon, model=lm.name,
        # reference traces observe nothing after divergence (window 0, docs/contract.md)
        window=0 if job.kind == Kind.REFERENCE else job.window or job.horizon,
        eos_token_id=lm.eos_token_id, sampling=job.sampling.as_dict(), candidate=candidate,
        eos_token_ids=list(lm.eos_token_ids),
        reference=reference, seed=seed, prompt_tokens=job.prompt_len,
        prompt_sha256=prompt_digest([*job.prompt_ids, *job.question_ids]), retained_tokens=q0.kept + nq,
        replicates=job.replicates, vocab_size=lm.vocab_size, doc=job.doc, request_id=job.request_id,
        coupling="stepwise-maximal", producer=PRODUCER, reference_retained_tokens=p0.kept + nq,
        **numerics(lm, fuse), **extra,
    )
