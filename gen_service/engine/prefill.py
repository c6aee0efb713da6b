"""Prefill: one policy's prompt state, or P's and Q's from one forward where that is exact.

kvpress compresses inside the prefill forward: each layer attends to the whole prompt
and its cache is compressed right after that layer, so the step-1 logits are the full
model's whatever the press. A question is prefilled after compression, as kvpress's
pipeline does, and is never compressed.

A document's several candidates share one forward (:func:`prefill_document`): P's
full cache is that forward's, and every press that only compresses after each layer's
attention (:func:`gen_service.presses.traits.compresses_after_attention`) compresses a
copy of each layer's keys and values inside it, as its own forward would have.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from gen_service.attention.head_masks import indices_to_mask
from gen_service.attention.plan import layer_windows
from gen_service.engine.forwards import attention_layers, eager_attention, run_side
from gen_service.engine.jobs import Built
from gen_service.engine.sides import Prefilled, Side, cache_lengths
from gen_service.models.float_head import logits as fp32_logits
from gen_service.presses.layered import compressible_layers, press_applied
from gen_service.presses.quantized import kivi_cache
from gen_service.presses.registry import Policy, PressPlan
from gen_service.presses.traits import compresses_after_attention, wants_eager

__all__ = ["derives_from_full_forward", "mark_sliding", "prefill", "prefill_document", "prefill_pair",
           "prefill_question", "question_masks"]


@torch.inference_mode()
def prefill(model: torch.nn.Module, policy: Policy | Built, prompt_ids: list[int],
            question_ids: Sequence[int] = ()) -> Prefilled:
    """Prefill under the policy's press (the question, if any, after compression)."""
    return _prefill(model, policy.plan(len(prompt_ids)), prompt_ids, question_ids)


def _prefill(model: torch.nn.Module, plan: PressPlan, prompt_ids: list[int],
             question_ids: Sequence[int] = ()) -> Prefilled:
    """Prefill under ``plan``, the policy's plan for this prompt (made once: its press is fresh)."""
    device = model.device
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    cache = DynamicCache() if plan.quant is None else kivi_cache(plan.quant, model.config.num_hidden_layers)
    positions = torch.arange(len(prompt_ids), device=device)[None]
    press = plan.press  # a decoding-only press's hooks do nothing during prefill
    applied = press_applied(press, model) if press is not None else nullcontext()
    with eager_attention(model, wants_eager(press)), applied:
        out = fp32_logits(model, 1, input_ids=ids, past_key_values=cache, position_ids=positions)
    return _finish(model, plan, cache, out[:, -1], len(prompt_ids), question_ids)


def _finish(model: torch.nn.Module, plan: PressPlan, cache: DynamicCache, logits: torch.Tensor, context_len: int,
            question_ids: Sequence[int], indices: list[Any] | None = None) -> Prefilled:
    mark_sliding(model, cache)
    masks = _take_masks(model, cache) if indices is None else _masks_of(indices, cache)
    side = Side(cache, context_len, masks=masks, press=plan.press if plan.decoding else None)
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
    decoding press kept of it). One forward when every layer keeps as many slots, or when
    the counts differ only between layer types (a model with windowed layers, its global
    ones compressed: one mask per type, :func:`question_masks`); otherwise (PyramidKV &
    co.: one mask cannot fit the layers) one token at a time, the same attention without
    a mask."""
    q = torch.tensor([question_ids], dtype=torch.long, device=model.device)
    pos = torch.arange(side.next_pos, side.next_pos + q.shape[1], device=model.device)[None]
    lengths = cache_lengths(side.cache)
    uniform = len(set(lengths)) == 1
    masks = None if uniform else question_masks(model, lengths, q.shape[1])
    if uniform or masks is not None:
        logits = run_side(model, side, q, pos, mask=masks, logits_to_keep=1)
    else:
        last = q.shape[1] - 1
        for i in range(q.shape[1]):
            # only the last token's law is read: the others advance the cache without the head
            logits = run_side(model, side, q[:, i:i + 1], pos[:, i:i + 1], head=i == last)
    side.next_pos += q.shape[1]
    return logits


def question_masks(model: torch.nn.Module, lengths: list[int], n: int) -> dict[str, torch.Tensor] | None:
    """Additive (1, 1, n, slots + n) masks, one per layer type, for ``n`` tokens fed after a
    cache whose layers hold ``lengths`` slots, in the form transformers' models with
    ``layer_types`` take (a dict by type, used as given); None where a type's layers hold
    different counts or a type is neither full nor sliding attention.

    Every cached slot precedes the question, so a global layer's query sees all of them
    and the question causally, wherever a press left its keys. A windowed layer is never
    compressed (gen_service.presses.layered), so its slots are the positions just before
    the question, contiguous: a query sees the keys less than a window behind it, as the
    model's own sliding mask (and the token-by-token feed) lets it."""
    types = getattr(model.config, "layer_types", None)
    if not types or len(types) != len(lengths):
        return None
    kept: dict[str, tuple[int, int | None]] = {}
    for kind, slots, window in zip(types, lengths, layer_windows(model.config), strict=True):
        known = kind in ("full_attention", "sliding_attention")
        if not known or kept.setdefault(kind, (slots, window)) != (slots, window):
            return None
    dtype, device = model.dtype, model.device
    masks = {}
    for kind, (slots, window) in kept.items():
        behind = slots + torch.arange(n, device=device)[:, None] - torch.arange(slots + n, device=device)[None]
        visible = behind >= 0 if window is None else (behind >= 0) & (behind < window)
        masks[kind] = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(
            ~visible, torch.finfo(dtype).min)[None, None]
    return masks


def _take_masks(model: torch.nn.Module, cache: DynamicCache) -> list[torch.Tensor | None] | None:
    """Move head-wise masks (kvpress's ``masked_key_indices``, left on the shared
    modules for batch 1) into the side that owns them, as boolean (1, heads, slots)."""
    return _masks_of([_take_indices(attn) for attn in attention_layers(model)], cache)


def _take_indices(attn: torch.nn.Module) -> Any:
    idx = getattr(attn, "masked_key_indices", None)
    attn.masked_key_indices = None
    return idx


def _masks_of(indices: list[Any], cache: DynamicCache) -> list[torch.Tensor | None] | None:
    """Per-layer ``masked_key_indices`` as boolean (1, heads, slots) masks (None: no layer masks)."""
    masks = [None if idx is None else indices_to_mask(idx, 1, layer.keys.shape[1], layer.keys.shape[-2])
             for idx, layer in zip(indices, cache.layers, strict=True)]
    return masks if any(m is not None for m in masks) else None


@torch.inference_mode()
def prefill_pair(model: torch.nn.Module, ref: Policy | Built, cand: Policy | Built, prompt_ids: list[int],
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
        return (_prefill(model, ref_plan, prompt_ids, question_ids),
                _prefill(model, cand_plan, prompt_ids, question_ids))
    full: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        # clone: a press may edit the tensors it is handed
        full[module.layer_idx] = (layer.keys.clone(), layer.values.clone())

    hooks = [attn.register_forward_hook(keep, with_kwargs=True) for attn in attention_layers(model)]
    try:
        # the prompt only: were the question fed while the hooks are on, they would
        # keep Q's compressed cache + question for P
        q0 = _prefill(model, cand_plan, prompt_ids)
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


def derives_from_full_forward(plan: PressPlan) -> bool:
    """Whether a policy's prompt state comes out of the document's one full forward
    (:func:`prefill_document`): no press, or one that only compresses after each
    layer's attention, on a plain (not quantized) cache."""
    return plan.quant is None and not plan.decoding and compresses_after_attention(plan.press)


def _aliased(cache: DynamicCache) -> DynamicCache:
    """A cache object of its own over the same tensors. Nothing edits a prompt's tensors
    in place (decoding appends by concatenation or into buffers of its own, and the
    shared prompt path copies the prompt into its pool), so sides may share them."""
    out = DynamicCache()
    for layer in cache.layers:
        new = DynamicLayer()
        new.lazy_initialization(layer.keys, layer.values)
        new.keys, new.values = layer.keys, layer.values
        out.layers.append(new)
    return out


def _shared(pre: Prefilled, plan: PressPlan | None = None) -> Prefilled:
    """``pre`` over the same tensors, in a side of its own (each candidate decodes its own rows)."""
    side = Side(_aliased(pre.cache), pre.side.next_pos, pre.side.masks, pre.side.press)
    return replace(pre, side=side, plan=pre.plan if plan is None else plan)


class _Derived:
    """One candidate's press run inside the document's forward on a copy of each layer's
    full keys and values, as kvpress's own hook would run it inside a forward of its own."""

    def __init__(self, plan: PressPlan, compressible: set[int]):
        self.plan, self.cache = plan, DynamicCache()
        self.compressible = compressible   # the layered rule (gen_service.presses.layered): windowed layers kept whole
        self.indices: list[Any] = []     # per layer: the press's masked_key_indices (head-wise presses)
        self.error: Exception | None = None
        self.hook = plan.press.forward_hook   # bound now: kvpress's context gets a stand-in (below)

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        idx = module.layer_idx
        full = kwargs["past_key_values"].layers[idx]
        # a copy (DynamicLayer.update concatenates): the press compresses its own
        self.cache.update(full.keys, full.values, idx)
        if self.error is None and idx in self.compressible:
            try:
                self.hook(module, args, {**kwargs, "past_key_values": self.cache}, output)
            except Exception as exc:   # this candidate's failure: the forward goes on for the others
                self.error = exc
        # head-wise presses leave their indices on the shared module: each candidate keeps its own
        self.indices.append(_take_indices(module))

    @contextlib.contextmanager
    def setup(self, model: torch.nn.Module) -> Iterator[None]:
        """kvpress's own context for the press (``post_init_from_model``, the layers'
        ``rotary_emb``) under the layered rule (each compressed layer's own rotary
        embedding), with a hook that does nothing in place of the press's: the
        candidate's hook is :meth:`__call__`."""
        press = self.plan.press
        press.forward_hook = _unhooked
        try:
            with press_applied(press, model):
                yield
        finally:
            del press.forward_hook


def _unhooked(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    return None


@torch.inference_mode()
def prefill_document(model: torch.nn.Module, ref: Policy | Built, cands: Sequence[Policy | Built],
                     prompt_ids: list[int],
                     question_ids: Sequence[int] = ()) -> list[tuple[Prefilled, Prefilled] | Exception]:
    """P's and every candidate's Q's prompt states for one document, P's prompt prefilled once.

    One forward of the full model over the prompt gives P's cache. Each candidate whose
    press only compresses after each layer's attention (:func:`derives_from_full_forward`)
    compresses a copy of each layer's keys and values inside that forward, handed the
    hidden states and keyword arguments its own forward would hand it (they are the
    full model's: compression follows each layer's attention), so its cache is bit for
    bit the one its own forward builds. The others (presses that change the forward,
    act while decoding or score with attention weights; quantized caches) prefill Q by
    a forward of their own and share P. Every candidate's P side holds the same tensors,
    and so does the full control's Q side: the prompt is stored once. With a press on
    the reference, every candidate is prefilled on its own (:func:`prefill_pair`).

    Returns
    -------
    list
        Per candidate, ``(p0, q0)``, or the exception its prefill raised.
    """
    L = len(prompt_ids)
    ref_plan = ref.plan(L)
    if ref_plan.press is not None or ref_plan.quant is not None:
        return [_attempt(lambda c=c: prefill_pair(model, ref, c, prompt_ids, question_ids)) for c in cands]
    plans = [c.plan(L) for c in cands]
    compressible = set(compressible_layers(model))
    derived = {i: _Derived(plan, compressible) for i, plan in enumerate(plans)
               if plan.press is not None and derives_from_full_forward(plan)}
    cache = DynamicCache()
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)
    positions = torch.arange(L, device=model.device)[None]
    with contextlib.ExitStack() as stack:
        for d in derived.values():
            stack.enter_context(d.setup(model))
        for attn in attention_layers(model):
            for d in derived.values():   # each layer: every candidate's press, in candidate order
                stack.callback(attn.register_forward_hook(d, with_kwargs=True).remove)
        logits = fp32_logits(model, 1, input_ids=ids, past_key_values=cache, position_ids=positions)[:, -1]
    p0 = _finish(model, ref_plan, cache, logits, L, question_ids, [None] * len(cache.layers))
    results: list[tuple[Prefilled, Prefilled] | Exception] = []
    for i, plan in enumerate(plans):
        d = derived.get(i)
        if d is not None:
            results.append(d.error or _attempt(lambda d=d: (_shared(p0), _finish(
                model, d.plan, d.cache, logits, L, question_ids, d.indices))))
        elif plan.press is None and plan.quant is None:    # the full control: Q is P
            results.append((_shared(p0), _shared(p0, plan)))
        else:
            results.append(_attempt(lambda plan=plan: (_shared(p0), _prefill(model, plan, prompt_ids, question_ids))))
    return results


def _attempt(prefill_one: Callable[[], Any]) -> Any:
    """``prefill_one()``, or the exception it raised (it is that candidate's alone)."""
    try:
        return prefill_one()
    except Exception as exc:
        return exc
