"""The data the decoding loops and the scheduler exchange: sides, forwards, prefill states.

A :class:`Side` is one model's decoding state and is mutable on purpose: the cache
grows in place at every forward (copying it per step is what the shared prompt cache
exists to avoid), and rows leave the batch as residual branches end. The records
passed between the loops and the scheduler (:class:`Forward`) and out of prefill
(:class:`Prefilled`) are frozen.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from gen_service.presses.registry import PressPlan
from gen_service.presses.traits import repeat_rows

__all__ = ["Forward", "Prefilled", "Side", "cache_lengths"]


def cache_lengths(cache: DynamicCache) -> list[int]:
    """Slots per layer."""
    return [layer.get_seq_length() for layer in cache.layers]


@dataclass
class Side:
    """One model's decoding state: its cache and what its policy applies to its forwards.

    ``masks[l]`` (rows, kv_heads, slots) marks keys hidden from layer l's attention
    (head-wise presses); ``press`` is a press whose hooks run during this side's
    decoding forwards; ``next_pos`` is the position of the next token fed.
    """

    cache: DynamicCache
    next_pos: int
    masks: list[torch.Tensor | None] | None = None
    press: Any | None = None

    def rows(self, n: int) -> None:
        """Batch 1 -> n identical rows (cache, masks and the decoding press's per-row state)."""
        self.cache.batch_repeat_interleave(n)
        if self.masks:
            self.masks = [None if m is None else m.repeat(n, 1, 1) for m in self.masks]
        if self.press is not None:
            repeat_rows(self.press, n)

    def select(self, idx: torch.Tensor) -> None:
        self.cache.batch_select_indices(idx)
        if self.masks:
            self.masks = [None if m is None else m[idx] for m in self.masks]

    def crop(self, lengths: list[int]) -> None:
        for layer, n in zip(self.cache.layers, lengths, strict=True):
            layer.crop(n)
        if self.masks:
            self.masks = [None if m is None else m[..., :n] for m, n in zip(self.masks, lengths, strict=True)]

    def snapshot(self) -> Side:
        """An independent copy (cache, masks and press state)."""
        return Side(copy.deepcopy(self.cache), self.next_pos,
                    None if self.masks is None else [None if m is None else m.clone() for m in self.masks],
                    copy.deepcopy(self.press))

    def kept_per_layer(self) -> list[float]:
        """Slots visible per layer, on average over heads (masked keys excluded)."""
        out = []
        for i, n in enumerate(cache_lengths(self.cache)):
            m = self.masks[i] if self.masks else None
            out.append(n - (0.0 if m is None else float(m[0].sum()) / m.shape[1]))
        return out

    def kept(self) -> int:
        """Prompt slots visible on average over layers and heads (masked keys excluded)."""
        return int(round(sum(self.kept_per_layer()) / max(len(self.cache.layers), 1)))


@dataclass(frozen=True)
class Forward:
    """One decoding forward a decoding loop asks for: ``side`` over (rows,) ``tokens`` at
    (rows,) ``positions``, with an optional (rows, slots) ``mask``; ``eager`` asks for
    eager attention with the mask on CPU (the residual prefix branches). The loops yield
    a list of these (P's and Q's) and receive each one's (rows, V) logits back, so that
    the scheduler decides how the forwards run: one by one, or stacked with other
    candidates' (:mod:`gen_service.engine.scheduler`)."""

    side: Side
    tokens: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor | None = None
    eager: bool = False


@dataclass(frozen=True)
class Prefilled:
    """One policy's prompt state (batch 1) and the step-1 logits."""

    side: Side
    logits: torch.Tensor   # (1, V)
    kept: int              # prompt slots in the cache after compression (mean over layers)
    plan: PressPlan
    kept_slots: list[int] = field(default_factory=list)  # cache slots per layer before decoding
    # slots visible per layer after compression (head masks counted), before any question
    kept_layers: list[float] = field(default_factory=list)

    @property
    def cache(self) -> DynamicCache:
        return self.side.cache
