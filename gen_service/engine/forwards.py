"""Running forwards: one side's over its own cache, or several shared-prompt sides' as one.

A side's head masks and decoding-press hooks sit on the model's shared attention
modules for exactly that side's forward (:func:`side_applied`), so nothing leaks into
the other model's forwards. Nothing here decides *which* forwards run together: that
is the scheduler's (:mod:`gen_service.engine.scheduler`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch

from gen_service.attention.head_masks import HIDDEN_ATTR, indices_to_mask, pad
from gen_service.attention.plan import layer_windows
from gen_service.attention.shared_cache import StackedPromptCache, attention_route
from gen_service.engine.sides import Forward, Side, cache_lengths
from gen_service.models.float_head import advance
from gen_service.models.float_head import logits as fp32_logits
from gen_service.presses.layered import decoding_hooks

__all__ = ["attention_layers", "eager_attention", "masked_attention", "run_side", "run_stacked", "side_applied"]


def attention_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's attention modules, layer order (where hooks and masks go)."""
    return [layer.self_attn for layer in model.model.layers]


@torch.inference_mode()
def run_side(model: torch.nn.Module, side: Side, tokens: torch.Tensor, positions: torch.Tensor,
             mask: torch.Tensor | None = None, logits_to_keep: int = 0, head: bool = True) -> torch.Tensor | None:
    """One forward of ``side`` over (rows, n) tokens -> (rows, V) float32 logits of the
    last one (:func:`gen_service.models.float_head.logits`: the final norm and the head in float32),
    with that side's head masks and decoding hooks in place. ``head=False``: the cache
    advances and no logits are made (None; :func:`gen_service.models.float_head.advance`)."""
    with side_applied(model, side, tokens.shape[1]), attention_route(model, side.cache, mask, positions) as (mask, kw):
        if not kw and any(w is not None for w in layer_windows(model.config)):
            # the model's own attention over per-row copies: its window mask reads the
            # slots from cache_position, which transformers would take from layer 0's
            # length (compressed, where layer 0 is global); windowed layers keep every slot
            start = max(cache_lengths(side.cache))
            kw = {"cache_position": torch.arange(start, start + tokens.shape[1], device=tokens.device)}
        inputs = dict(input_ids=tokens, past_key_values=side.cache, position_ids=positions, attention_mask=mask,
                      use_cache=True, **kw)
        if not head:
            advance(model, **inputs)
            return None
        out = fp32_logits(model, logits_to_keep, **inputs)
    return out[:, -1]


@torch.inference_mode()
def run_stacked(model: torch.nn.Module, forwards: list[Forward], static: bool = False) -> list[torch.Tensor]:
    """One forward over several shared-prompt sides' rows (:class:`StackedPromptCache`;
    ``static``: its static-shape form, as :mod:`gen_service.engine.graphs` captures it)."""
    stack = StackedPromptCache([f.side.cache for f in forwards], [f.mask for f in forwards], static=static)
    tokens = torch.cat([f.tokens for f in forwards])[:, None]
    positions = torch.cat([f.positions for f in forwards])[:, None]
    with attention_route(model, stack, None, positions) as (_, kw):
        out = fp32_logits(model, 0, input_ids=tokens, past_key_values=stack, position_ids=positions,
                          use_cache=True, **kw)
    return list(out[:, -1].split([f.tokens.shape[0] for f in forwards]))


@contextmanager
def side_applied(model: torch.nn.Module, side: Side, n_new: int) -> Iterator[None]:
    """Install ``side``'s head masks and decoding hooks for one forward, then take
    them off the shared modules (with any masks a press added meanwhile)."""
    if side.masks is None and side.press is None:
        yield
        return
    attns = attention_layers(model)
    hooks = []
    if side.masks is not None:
        for attn, m, n in zip(attns, side.masks, cache_lengths(side.cache), strict=True):
            setattr(attn, HIDDEN_ATTR, None if m is None else pad(m, n + n_new))
    if side.press is not None:
        hooks = decoding_hooks(side.press, model)     # the compressible layers only (gen_service.presses.layered)
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        side.masks = _collect_masks(attns, side)


def _collect_masks(attns: list[torch.nn.Module], side: Side) -> list[torch.Tensor | None] | None:
    """Take the masks off the modules, merged with those a press added (e.g. DMS evicting
    while decoding), each padded to its layer's slots."""
    shape = side.cache.layers[0].keys.shape
    masks = []
    for attn, n in zip(attns, cache_lengths(side.cache), strict=True):
        m, added = getattr(attn, HIDDEN_ATTR, None), getattr(attn, "masked_key_indices", None)
        setattr(attn, HIDDEN_ATTR, None)
        attn.masked_key_indices = None
        if added is not None:
            fresh = indices_to_mask(added, shape[0], shape[1], n)
            m = fresh if m is None else pad(m, fresh.shape[-1]) | fresh
        masks.append(None if m is None else pad(m, n))
    return masks if any(m is not None for m in masks) else None


@contextmanager
def eager_attention(model: torch.nn.Module, on: bool = True) -> Iterator[None]:
    """The model under eager attention while inside (``on``), as it was after."""
    if not on:
        yield
        return
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def masked_attention(model: torch.nn.Module, device: torch.device) -> AbstractContextManager[None]:
    """On CPU, torch's SDPA with a real (non-trivial) mask leaves its fast kernel and
    was ~2.5x slower per decoding step than with no mask; eager attention with the
    same mask was ~1.5-2x faster than that (SmolLM2, 8 rows, 570 slots). GPUs keep SDPA."""
    before = getattr(model.config, "_attn_implementation", None)
    return eager_attention(model, device.type == "cpu" and before == "sdpa")
