"""TGI's plain sampling (``/generate``) from one policy's kernel, and prompt log-probabilities."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch

from gen_service.engine.context import history
from gen_service.engine.coupling import categorical, probs
from gen_service.engine.jobs import Sampling, check
from gen_service.engine.readback import FiniteGuard
from gen_service.engine.sides import Prefilled, Side
from gen_service.models.float_head import logits as fp32_logits

__all__ = ["generate", "prompt_logprobs"]

Step = Callable[[Side, torch.Tensor, torch.Tensor], torch.Tensor]


def generate(pre: Prefilled, step: Step, gen: torch.Generator, eos: Collection[int], device: torch.device,
             prompt_ids: list[int], max_new_tokens: int, sampling: Sampling, top_n: int = 0,
             stop_check: Callable[[list[int]], bool] | None = None,
             cancelled: Callable[[], bool] = lambda: False) -> Iterator[dict[str, Any]]:
    """Sample from a prefilled state: one dict per token with id, logprob (the model's, as
    TGI reports it) and top tokens, and finally a dict with the finish reason. ``step``
    runs one decoding forward of the side; any id in ``eos`` (the model's EOS ids)
    ends the generation with ``eos_token``."""
    logits, side = pre.logits, pre.side
    out: list[int] = []
    hist = history(sampling, prompt_ids, 1, logits.shape[-1], device)
    guard = FiniteGuard(device)   # a NaN row must not be sampled (gen_service.engine.readback)
    for t in range(1, max_new_tokens + 1):
        check(cancelled)
        (logits,) = guard(t, f"token {t}", logits)
        p = probs(logits, sampling, hist)
        tok = p.argmax(-1) if sampling.greedy else categorical(p, gen)
        tid, *bad = torch.cat([tok.reshape(1), guard.take()]).tolist()   # one host copy, as int(tok) was
        failed = guard.failure(bad)
        if failed is not None:
            raise failed
        if hist is not None:
            hist = hist.add(tok.reshape(1))
        out.append(tid)
        yield _item(logits, tid, top_n)
        if tid in eos:
            yield {"finish_reason": "eos_token"}
            return
        if stop_check is not None and stop_check(out):
            yield {"finish_reason": "stop_sequence"}
            return
        if t < max_new_tokens:
            pos = torch.full((1,), side.next_pos + t - 1, dtype=torch.long, device=device)
            logits = step(side, tok, pos)
    yield {"finish_reason": "length"}


def _item(logits: torch.Tensor, tid: int, top_n: int) -> dict[str, Any]:
    lp = torch.log_softmax(logits, -1)  # TGI reports the model's log-probability
    item: dict[str, Any] = {"id": tid, "logprob": float(lp[0, tid]), "top": []}
    if top_n:
        vals, ids = lp[0].topk(top_n)
        item["top"] = list(zip(ids.tolist(), vals.tolist(), strict=True))
    return item


@torch.inference_mode()
def prompt_logprobs(model: torch.nn.Module, prompt_ids: list[int]) -> list[float | None]:
    """Log-probabilities of each prompt token under the full model (TGI prefill details), from
    float32 logits (:func:`gen_service.models.float_head.logits`); no cache is kept. Its peak memory,
    the (L, V) float32 logits and their log-softmax, is admitted by
    :func:`gen_service.serving.memory.prompt_logprobs_bytes`."""
    ids = torch.tensor([prompt_ids], device=model.device)
    lp = fp32_logits(model, 0, input_ids=ids, use_cache=False)[0].log_softmax(-1)
    lps: list[float | None] = [None]
    lps += lp[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()
    return lps

