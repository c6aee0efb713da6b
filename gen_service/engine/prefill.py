"""Prefill: one policy's prompt state, or P's and Q's from one forward where that is exact.

kvpress compresses inside the prefill forward: each layer attends to the whole prompt
and its cache is compressed right after that layer, so the step-1 logits are the full
model's whatever the press. A question is prefilled after compression, as kvpress's
pipeline does, and is never compressed.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch
from transformers import DynamicCache

from gen_service.attention.head_masks import indices_to_mask
from gen_service.attention.plan import layer_windows
from gen_service.engine.forwards import attention_layers, eager_attention, run_side
from gen_service.engine.sides import Prefilled, Side, cache_lengths
from gen_service.models.float_head import logits as fp32_logits
from gen_service.presses.layered import press_applied
from gen_service.presses.registry import Policy, PressPlan
from gen_service.presses.traits import wants_eager

__all__ = ["mark_sliding", "prefill", "prefill_pair", "prefill_question"]


@torch.inference_mode()
def prefill(model: torch.nn.Module, policy: Policy, prompt_ids: list[int],
            question_ids: Sequence[int] = ()) -> Prefilled:
    """Prefill under the policy's press (the question, if any, after compression)."""
    device = model.device
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    plan = policy.plan(len(prompt_ids))
    cache = DynamicCache() if plan.quant is None else plan.quant.cache(model.config.num_hidden_layers)
    positions = torch.arange(len(prompt_ids), device=device)[None]
    press = plan.press  # a decoding-only press's hooks do nothing during prefill
    applied = press_applied(press, model) if press is not None else nullcontext()
    with eager_attention(model, wants_eager(press)), applied:
        out = fp32_logits(model, 1, input_ids=ids, past_key_values=cache, position_ids=positions)
    return _finish(model, plan, cache, out[:, -1], len(prompt_ids), question_ids)


def _finish(model: torch.nn.Module, plan: PressPlan, cache: DynamicCache, logits: torch.Tensor, context_len: int,
            question_ids: Sequence[int]) -> Prefilled:
    mark_sliding(model, cache)
    side = Side(cache, context_len, masks=_take_masks(model, cache), press=plan.press if plan.decoding else None)
    if plan.rerotates:  # kept keys were re-rotated to 0..kept-1: continue from there (as kvpress does)
        lengths = cache_lengths(cache)
        # ...except past uncompressed windowed layers, whose slot i is position i: a query
        # before their last key would see none of its window
        side.next_pos = max(lengths) if any(w is not None for w in layer_windows(model.config)) else lengths[0]
    kept, layers = side.kept(), side.kept_per_layer()
    if question_ids:
        logits = prefill_question(model, side, list(question_ids))
    return Prefilled(side, logits, kept, plan, cache_lengths(cache), layers)


def mark_sliding(model: torch.nn.Module, cache: DynamicCache) -> None:
    """Flag the cache's windowed layers as sliding, every slot kept. transformers builds one
    mask per layer type from the first layer flagged so (``is_sliding``); unflagged, a
    windowed layer's mask would be sized from a global layer, which a press compressed
    (gen_service.presses.layered), and the model's own attention over per-row copies could not
    run. Shared-prompt sides ignore the flag: the cascade applies the window itself."""
    for layer, window in zip(cache.layers, layer_windows(model.config), strict=False):
        if window is not None:
            layer.is_sliding = True


def prefill_question(model: torch.nn.Module, side: Side, question_ids: list[int]) -> torch.Tensor:
    """Feed the question after compression (batch 1; :meth:`Side.rows` repeats what a
    decoding press kept of it). When layers keep different numbers of slots (PyramidKV
    & co.) one causal mask cannot fit them all, so the question goes in one token at a
    time (the same attention, without a mask)."""
    q = torch.tensor([question_ids], dtype=torch.long, device=model.device)
    pos = torch.arange(side.next_pos, side.next_pos + q.shape[1], device=model.device)[None]
    if len(set(cache_lengths(side.cache))) == 1:
        logits = run_side(model, side, q, pos, logits_to_keep=1)
    else:
        for i in range(q.shape[1]):
            logits = run_side(model, side, q[:, i:i + 1], pos[:, i:i + 1])
    side.next_pos += q.shape[1]
    return logits


def _take_masks(model: torch.nn.Module, cache: DynamicCache) -> list[torch.Tensor | None] | None:
    """Move head-wise masks (kvpress's ``masked_key_indices``, left on the shared
    modules for batch 1) into the side that owns them, as boolean (1, heads, slots)."""
    masks: list[torch.Tensor | None] = []
    for attn, layer in zip(attention_layers(model), cache.layers, strict=True):
        idx = getattr(attn, "masked_key_indices", None)
        attn.masked_key_indices = None
        masks.append(None if idx is None else indices_to_mask(idx, 1, layer.keys.shape[1], layer.keys.shape[-2]))
    return masks if any(m is not None for m in masks) else None


@torch.inference_mode()
def prefill_pair(model: torch.nn.Module, ref: Policy, cand: Policy, prompt_ids: list[int],
                 question_ids: Sequence[int] = ()) -> tuple[Prefilled, Prefilled]:
    """P's and Q's prompt states. With a full reference both come from ONE forward:
    compression does not change a layer's output (it runs after the layer has
    attended to the whole prompt), so hooks registered before the press's keep
    each layer's uncompressed keys/values for P while the press compresses Q's."""
    L = len(prompt_ids)
    ref_plan, cand_plan = ref.plan(L), cand.plan(L)
    # A press scoring with attention weights prefills under eager attention, whose
    # logits differ from SDPA's in the last bits: P then gets its own forward.
    # A quantized candidate's cache holds no full-precision prompt to copy for P.
    if ref_plan.press is not None or ref_plan.quant is not None or cand_plan.quant is not None \
            or wants_eager(cand_plan.press):
        return prefill(model, ref, prompt_ids, question_ids), prefill(model, cand, prompt_ids, question_ids)
    full: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        # clone: a press may edit the tensors it is handed
        full[module.layer_idx] = (layer.keys.clone(), layer.values.clone())

    hooks = [attn.register_forward_hook(keep, with_kwargs=True) for attn in attention_layers(model)]
    try:
        # the prompt only: were the question fed while the hooks are on, they would
        # keep Q's compressed cache + question for P
        q0 = prefill(model, cand, prompt_ids)
    finally:
        for hook in hooks:
            hook.remove()
    cache = DynamicCache()
    for idx in sorted(full):
        cache.update(*full[idx], idx)
    p0 = _finish(model, ref_plan, cache, q0.logits, L, question_ids)
    if question_ids:  # what prefill(model, cand, prompt_ids, question_ids) would have done
        logits = prefill_question(model, q0.side, list(question_ids))
        q0 = replace(q0, logits=logits, kept_slots=cache_lengths(q0.cache))   # slots after the question
    return p0, q0
