"""The prompt's KV stored once per request, each row's own tokens in preallocated buffers.

A request decodes R rows from one prompt. transformers' ``DynamicCache`` would hold R
copies of the prompt's keys/values (``batch_repeat_interleave``) and append each new
token by concatenation, copying every layer's whole cache at every step. A
:class:`SharedPromptCache` keeps, per layer, the prompt once (batch 1, as prefill left
it, compressed or not) and each row's generated tokens in a buffer allocated for the
horizon, written in place. Its forwards attend through :mod:`gen_service.attention.cascade`
(prompt part broadcast over rows, row part batched, merged by log-sum-exp), routed by
:func:`attention_route` for that forward only. A :class:`StackedPromptCache` puts
several such caches (P's and Q's, or several candidates') in one forward's batch, each
group attending to its own prompt and rows.

Which path each mechanism takes (per side: P and Q decide independently):

================================================  ===================================
mechanism                                          path
================================================  ===================================
full cache, any prefill-only press (uniform or     shared prompt
per-layer budgets, ThinK, re-rotation, question)
residual branches (prefix shortcut)                shared prompt; branch masks cover
                                                   the rows' own slots only
residual branches replayed (decoding press or      shared prompt for a side without a
per-layer budgets)                                 decoding press
head-wise masks set at prefill (AdaKV,              shared prompt; the prompt's mask
CriticalAdaKV ...)                                 is shared by the rows too
decoding-time presses (DecodingPress, DMS &        per-row copies (the press edits
co.)                                               the cache it is handed)
any cache other than a plain DynamicCache          per-row copies
(quantized)
sliding-window layers, soft caps, sinks            shared prompt; the layer's window,
                                                   cap and sinks in the cascade
                                                   (gen_service.attention.plan)
================================================  ===================================
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from gen_service.attention.cascade import CACHE_KWARG, CASCADE, cascade_attention_forward

__all__ = ["STACKED_ATTENTION", "SharedPromptCache", "SharedPromptLayer", "StackedPromptCache", "attention_route",
           "can_share", "pooled_length", "share_prompt", "stackable"]

AttentionInterface.register(CASCADE, cascade_attention_forward)


class SharedPromptLayer(CacheLayerMixin):
    """One layer: the prompt's keys/values (1, heads, slots, dim) and the rows' own
    slots in (rows, heads, capacity, dim) buffers, the first ``filled`` in use."""

    is_compileable = False
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int):
        super().__init__()
        self.prompt_keys, self.prompt_values = keys, values
        # ``keys``/``values`` as other code reads them off a layer: the shared part
        self.keys, self.values = keys, values
        self.capacity = max(int(capacity), 1)
        self.rows = 1
        self.filled = 0
        self.row_keys: torch.Tensor | None = None
        self.row_values: torch.Tensor | None = None
        self.pool: Any = None        # the stacked forwards' buffers this layer's tensors sit in
        self.is_initialized = True

    # -- CacheLayerMixin
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the prompt part exists from the start."""

    def _allocate(self, rows: int, capacity: int) -> None:
        shape = (rows, self.prompt_keys.shape[1], capacity, self.prompt_keys.shape[-1])
        keys = self.prompt_keys.new_empty(shape)
        values = self.prompt_values.new_empty(shape[:-1] + (self.prompt_values.shape[-1],))
        if self.row_keys is not None and self.filled:
            keys[:, :, :self.filled] = self.row_keys[:, :, :self.filled]
            values[:, :, :self.filled] = self.row_values[:, :, :self.filled]
        self.row_keys, self.row_values, self.rows, self.capacity = keys, values, rows, capacity

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
               cache_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens into each row's buffer; return the rows' slots so far."""
        rows, n = key_states.shape[0], key_states.shape[-2]
        if self.row_keys is None or rows != self.rows:
            if self.filled:
                raise ValueError(f"shared prompt cache holds {self.rows} rows, got a forward over {rows}")
            self.row_keys = None
            self._allocate(rows, self.capacity)
        if self.filled + n > self.capacity:   # a longer run than planned: grow geometrically
            self._allocate(self.rows, max(2 * self.capacity, self.filled + n))
        self.row_keys[:, :, self.filled:self.filled + n] = key_states
        self.row_values[:, :, self.filled:self.filled + n] = value_states
        self.filled += n
        return self.row_keys[:, :, :self.filled], self.row_values[:, :, :self.filled]

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        return self.get_seq_length() + cache_position.shape[0], 0

    def get_seq_length(self) -> int:
        """Slots a row sees: the prompt's plus its own."""
        return self.prompt_keys.shape[-2] + self.filled

    def get_max_cache_shape(self) -> int:
        return -1

    # -- what the engine's Side does with a cache
    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` slots (the prompt is never cropped)."""
        self.filled = max(0, min(self.filled, max_length - self.prompt_keys.shape[-2]))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.row_keys is None:
            self.rows *= repeats
            return
        self._set_rows(self.row_keys.repeat_interleave(repeats, 0), self.row_values.repeat_interleave(repeats, 0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.row_keys is None:
            self.rows = len(indices)
            return
        self._set_rows(self.row_keys[indices], self.row_values[indices])

    def _set_rows(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.row_keys, self.row_values, self.rows = keys, values, keys.shape[0]

    def row_bytes(self) -> int:
        """Bytes of the rows' buffers (all rows, whole capacity)."""
        if self.row_keys is None:
            return 0
        return self.row_keys.numel() * self.row_keys.element_size() * 2

    def prompt_bytes(self) -> int:
        return (self.prompt_keys.numel() * self.prompt_keys.element_size()
                + self.prompt_values.numel() * self.prompt_values.element_size())


class SharedPromptCache(Cache):
    """A cache whose prompt part is stored once for all rows.

    Built from a batch-1 ``DynamicCache`` after prefill (:func:`share_prompt`); then
    ``batch_repeat_interleave(R)`` makes R rows without copying the prompt, and each
    forward writes the rows' new tokens into per-row buffers sized for ``capacity``
    tokens (grown by doubling if a run goes longer). ``row_mask`` is set per forward by
    :func:`attention_route`: the (rows, slots) mask of the call, whose last columns
    cover the rows' own slots (the prompt part is always visible).

    Examples
    --------
    >>> from transformers import DynamicCache
    >>> dc = DynamicCache()
    >>> _ = dc.update(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), 0)
    >>> cache = SharedPromptCache.from_dynamic(dc, capacity=8)
    >>> cache.batch_repeat_interleave(3)
    >>> k, v = cache.update(torch.ones(3, 2, 1, 4), torch.ones(3, 2, 1, 4), 0)
    >>> tuple(k.shape), cache.get_seq_length()
    ((3, 2, 1, 4), 6)
    """

    def __init__(self, layers: list[SharedPromptLayer]):
        super().__init__(layers=layers)
        self.row_mask: torch.Tensor | None = None
        # the prompt's slots in a layer kept whole: slot i is position i there
        self.prompt_len = max(layer.prompt_keys.shape[-2] for layer in layers)
        # positions: of this forward's queries (rows, n), and of each row's own slots
        # (rows, capacity), which a sliding window needs (prefix branches leave gaps)
        self.q_pos: torch.Tensor | None = None
        self.row_pos: torch.Tensor | None = None

    @classmethod
    def from_dynamic(cls, cache: DynamicCache, capacity: int) -> SharedPromptCache:
        """Take over a batch-1 cache's tensors (no copy) as the shared prompt."""
        return cls([SharedPromptLayer(layer.keys, layer.values, capacity) for layer in cache.layers])

    def note_positions(self, positions: torch.Tensor) -> None:
        """Record this forward's (rows, n) positions: the queries', and those of the slots
        its tokens are about to be written to (every layer writes the same slots)."""
        rows, n = positions.shape
        at = self.layers[0].filled
        need = max(at + n, self.layers[0].capacity)
        if self.row_pos is None or self.row_pos.shape[0] != rows or self.row_pos.shape[1] < need:
            grown = positions.new_zeros(rows, max(need, 2 * (0 if self.row_pos is None else self.row_pos.shape[1])))
            if self.row_pos is not None and self.row_pos.shape[0] == rows and at:
                grown[:, :at] = self.row_pos[:, :at]
            self.row_pos = grown
        self.row_pos[:, at:at + n] = positions
        self.q_pos = positions

    def row_positions(self, m: int) -> torch.Tensor:
        """(rows, m) positions of each row's first m own slots."""
        return self.row_pos[:, :m]

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.row_pos is not None:
            self.row_pos = self.row_pos.repeat_interleave(repeats, 0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.row_pos is not None:
            self.row_pos = self.row_pos[indices]

    def row_bytes(self) -> int:
        return sum(layer.row_bytes() for layer in self.layers)

    def prompt_bytes(self) -> int:
        return sum(layer.prompt_bytes() for layer in self.layers)


#: keys per block of torch's CPU flash-attention kernel (``kv_split_size``): a pooled
#: prompt's key length is rounded up to a multiple of it on the CPU, so that a group's
#: keys fall in the same blocks, and its output is the same bits, whatever the longest
#: prompt it shares the pool with (the padding blocks add exact zeros)
CPU_KEY_BLOCK = 512

#: how a stacked forward attends: "batched" (every group in one call per layer, over the
#: pooled buffers below) or "loop" (group by group, the earlier way; kept as the
#: baseline benchmarks/bench_engine_ops.py measures against)
STACKED_ATTENTION = "batched"


class _Pool:
    """One layer's buffers for a stack of groups, each group's own tensors views of them.

    ``prompt_keys``/``prompt_values`` are (G, heads, L_max, dim): group g's prompt in
    its first L_g slots (shorter prompts padded, ``pad`` marks the padding), and the
    rows' buffers ``row_keys``/``row_values`` are (Σ rows, heads, capacity, dim). Each
    group's ``SharedPromptLayer`` is re-pointed at its slice (no copy kept twice), so
    attention reads every group with one call, and the pool stays valid for as long as
    every group still holds the very views it was given (a group that grows its
    buffer, or whose rows are selected, gets new tensors: the next stack rebuilds)."""

    def __init__(self, parts: list[SharedPromptLayer], previous: _Pool | None = None):
        G = len(parts)
        lengths = [p.prompt_keys.shape[-2] for p in parts]
        first = parts[0].prompt_keys
        longest = pooled_length(max(lengths), first.device)
        vals = parts[0].prompt_values
        # the same groups whose rows changed (a branch ended): keep the pooled prompts,
        # so a rebuild copies only the rows' buffers
        same = (previous is not None and len(previous.views) == G
                and all(p.prompt_keys is k for p, (k, _) in zip(parts, previous.views, strict=True)))
        if same:
            self.prompt_keys, self.prompt_values = previous.prompt_keys, previous.prompt_values
        else:
            # empty, then each group's prompt and zeros after it: the padding is masked, but
            # a masked score times garbage could be NaN; zeroing it all first cost a full
            # pass over (G, heads, L_max, dim) at every stack (8 ms a layer for Gemma 3's 14 groups)
            self.prompt_keys = first.new_empty((G, first.shape[1], longest, first.shape[-1]))
            self.prompt_values = vals.new_empty((G, vals.shape[1], longest, vals.shape[-1]))
        if previous is not None:      # its rows' buffers go as soon as no group reads them
            previous.row_keys = previous.row_values = None
        need = max(p.filled for p in parts) + 1
        capacity = max(p.capacity for p in parts)
        capacity = capacity if need <= capacity else max(2 * capacity, need)   # grow geometrically
        rows = [p.rows for p in parts]
        self.row_keys = first.new_zeros((sum(rows), first.shape[1], capacity, first.shape[-1]))
        self.row_values = vals.new_zeros((sum(rows), vals.shape[1], capacity, vals.shape[-1]))
        a = 0
        for g, (part, n) in enumerate(zip(parts, lengths, strict=True)):
            if not same:
                self.prompt_keys[g, :, :n] = part.prompt_keys[0]
                self.prompt_values[g, :, :n] = part.prompt_values[0]
                self.prompt_keys[g, :, n:] = 0
                self.prompt_values[g, :, n:] = 0
            b = a + part.rows
            if part.row_keys is not None and part.filled:
                self.row_keys[a:b, :, :part.filled] = part.row_keys[:, :, :part.filled]
                self.row_values[a:b, :, :part.filled] = part.row_values[:, :, :part.filled]
            part.prompt_keys = part.keys = self.prompt_keys[g:g + 1, :, :n]
            part.prompt_values = part.values = self.prompt_values[g:g + 1, :, :n]
            part.row_keys, part.row_values = self.row_keys[a:b], self.row_values[a:b]
            part.capacity = capacity
            part.pool = self
            a = b
        self.parts = list(parts)
        self.views = [(p.prompt_keys, p.row_keys) for p in parts]
        slot = torch.arange(longest, device=first.device)
        sizes = torch.tensor(lengths, device=first.device)
        # (G, 1, L_max): the padded slots, hidden from every query (None: none padded)
        self.pad = None if set(lengths) == {longest} else (slot[None, :] >= sizes[:, None])[:, None, :]

    def __deepcopy__(self, memo: dict) -> None:
        """A copied layer (a snapshot) owns its tensors and no pool: nothing to copy."""
        return None

    def holds(self, parts: list[SharedPromptLayer]) -> bool:
        """Whether these groups, in this order, still sit in this pool's buffers."""
        return (self.row_keys is not None and len(parts) == len(self.parts)
                and max(p.filled for p in parts) < self.row_keys.shape[2]
                and all(p is q and p.prompt_keys is k and p.row_keys is r
                        for p, q, (k, r) in zip(parts, self.parts, self.views, strict=True)))


def pooled_length(longest: int, device: torch.device) -> int:
    """Slots of a pool's prompt part: the longest prompt, rounded up to the CPU kernel's
    key block (:data:`CPU_KEY_BLOCK`) on the CPU; CUDA keeps the longest (its kernels
    refuse a padded, masked stack)."""
    if device.type != "cpu":
        return longest
    return -(-longest // CPU_KEY_BLOCK) * CPU_KEY_BLOCK


class _StackedLayer(CacheLayerMixin):
    """One layer of a :class:`StackedPromptCache`: writes the new tokens into each group's
    rows (one write into the pool for all groups, batched mode)."""

    is_compileable = False
    is_sliding = False

    def __init__(self, parts: list[SharedPromptLayer], bounds: list[tuple[int, int]], stack: StackedPromptCache):
        super().__init__()
        self.parts, self.bounds, self.stack = parts, bounds, stack
        self.pool: _Pool | None = None
        if stack.batched:
            pool = getattr(parts[0], "pool", None)
            self.pool = pool if pool is not None and pool.holds(parts) else _Pool(parts, pool)
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: every group's layer exists."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
               cache_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write each group's rows into its own layer; the attention reads the groups back."""
        if self.pool is None:
            for part, (a, b) in zip(self.parts, self.bounds, strict=True):
                part.update(key_states[a:b], value_states[a:b], cache_kwargs)
            return key_states, value_states
        if key_states.shape[-2] != 1:
            raise ValueError(f"a stacked forward feeds one token per row, got {key_states.shape[-2]}")
        at = self.stack.write_at
        if isinstance(at, int):       # every group at the same fill: one slice for all rows
            self.pool.row_keys[:, :, at:at + 1] = key_states
            self.pool.row_values[:, :, at:at + 1] = value_states
        else:                         # per-row slots: one indexed write
            rows = torch.arange(key_states.shape[0], device=key_states.device)
            self.pool.row_keys[rows, :, at] = key_states[:, :, 0]
            self.pool.row_values[rows, :, at] = value_states[:, :, 0]
        for part in self.parts:
            part.filled += 1
        return key_states, value_states

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        return self.get_seq_length() + cache_position.shape[0], 0

    def get_seq_length(self) -> int:
        return max(part.get_seq_length() for part in self.parts)

    def get_max_cache_shape(self) -> int:
        return -1


class StackedPromptCache(Cache):
    """Several shared-prompt caches decoded by ONE forward, their rows stacked.

    Each group (one :class:`SharedPromptCache`: its own prompt, compressed or not, and
    its own rows) keeps its state; the forward's batch is the groups' rows in order.
    The row-wise parts of the model (projections, MLP, norms, rotary embeddings) run
    once over all rows. Attention also runs once per layer for all groups
    (:func:`gen_service.attention.cascade.stacked_cascade_attention`): the groups' prompts and
    rows live in one pooled buffer per layer (:class:`_Pool`, built on the first
    stacked forward and kept while the groups stay), shorter prompts padded and masked,
    so the number of tensor operations per forward does not grow with the groups.
    ``STACKED_ATTENTION = "loop"`` attends group by group instead, each group on
    exactly the tensors a forward of it alone would use.

    Parameters
    ----------
    caches : list of SharedPromptCache
        The groups, in batch order.
    masks : list of (torch.Tensor or None)
        Each group's (rows, slots) mask of its own slots for this forward (None: all).

    Examples
    --------
    >>> from transformers import DynamicCache
    >>> def one(slots, rows):
    ...     dc = DynamicCache()
    ...     _ = dc.update(torch.zeros(1, 2, slots, 4), torch.zeros(1, 2, slots, 4), 0)
    ...     cache = SharedPromptCache.from_dynamic(dc, capacity=4)
    ...     cache.batch_repeat_interleave(rows)
    ...     return cache
    >>> stack = StackedPromptCache([one(5, 2), one(3, 1)], [None, None])
    >>> _ = stack.update(torch.ones(3, 2, 1, 4), torch.ones(3, 2, 1, 4), 0)
    >>> [g.get_seq_length() for g in stack.groups], stack.rows
    ([6, 4], 3)
    """

    def __init__(self, caches: list[SharedPromptCache], masks: list[torch.Tensor | None], static: bool = False):
        rows = [c.layers[0].rows for c in caches]
        starts = [sum(rows[:i]) for i in range(len(rows))]
        bounds = [(a, a + n) for a, n in zip(starts, rows, strict=True)]
        self.groups, self.bounds, self.masks = caches, bounds, masks
        self.rows = sum(rows)
        self.q_pos: torch.Tensor | None = None
        self._row_pos: torch.Tensor | None = None
        self.batched = static or STACKED_ATTENTION == "batched"
        self.static = static
        layers = [_StackedLayer([c.layers[i] for c in caches], bounds, self) for i in range(len(caches[0].layers))]
        super().__init__(layers=layers)
        if self.batched:
            self._plan(caches, rows, masks)

    def note_positions(self, positions: torch.Tensor) -> None:
        """Each group records its rows' (rows, 1) positions (a sliding window reads them)."""
        for group, (a, b) in zip(self.groups, self.bounds, strict=True):
            group.note_positions(positions[a:b])
        self.q_pos = positions
        self._row_pos: torch.Tensor | None = None

    def row_positions(self, m: int) -> torch.Tensor:
        """(rows, m) positions of every row's first m own slots, made once per forward."""
        if self._row_pos is None or self._row_pos.shape[1] != m:
            parts = []
            for group in self.groups:
                pos = group.row_pos[:, :m]
                if pos.shape[1] < m:     # slots beyond a group's buffer are masked anyway
                    pos = torch.cat([pos, pos.new_zeros(pos.shape[0], m - pos.shape[1])], 1)
                parts.append(pos)
            self._row_pos = torch.cat(parts)
        return self._row_pos

    def _plan(self, caches: list[SharedPromptCache], rows: list[int], masks: list[torch.Tensor | None]) -> None:
        """What every layer of this forward shares, made once: where each row writes, which
        of the rows' slots each row sees, and how rows map to the padded query blocks.

        ``static``: every tensor a layer reads has the same shape at every step (writes
        at per-row slots held in a tensor, attention over the pool's whole capacity
        with the unfilled slots masked), so a CUDA graph captured at one step replays at
        the next with only these tensors' values changed."""
        fills = [c.layers[0].filled for c in caches]
        dev = caches[0].layers[0].prompt_keys.device
        per_row = [f for f, n in zip(fills, rows, strict=True) for _ in range(n)]
        uniform = len(set(fills)) == 1 and not self.static
        self.write_at: int | torch.Tensor = fills[0] if uniform else torch.tensor(per_row, device=dev)
        # the rows' slots attended after the write: the filled ones, or the whole buffer
        self.seen = self.layers[0].pool.row_keys.shape[2] if self.static else max(fills) + 1
        visible = None
        if not uniform:
            slot = torch.arange(self.seen, device=dev)
            visible = slot[None, :] <= self.write_at[:, None]
        if any(m is not None for m in masks):
            own = torch.ones(self.rows, self.seen, dtype=torch.bool, device=dev)
            for (a, b), m, f in zip(self.bounds, masks, fills, strict=True):
                if m is not None:     # a group's mask ends with its own slots, the new one included
                    own[a:b, :f + 1] = m[:, -(f + 1):].bool()
            visible = own if visible is None else visible & own
        self.visible = None if visible is None else visible[:, None, None, :]     # (rows, 1, 1, seen)
        # rows -> (group, index in group): the padded query blocks of the prompt part
        self.even = len(set(rows)) == 1
        self.widest = max(rows)
        self.row_group = None if self.even else torch.tensor(
            [g for g, n in enumerate(rows) for _ in range(n)], device=dev)
        self.row_index = None if self.even else torch.tensor([i for n in rows for i in range(n)], device=dev)


def stackable(side: Any) -> bool:
    """Whether a side's forward may share a batch with others' (:class:`StackedPromptCache`):
    a shared prompt cache, no per-head masks and no press acting while decoding."""
    return isinstance(side.cache, SharedPromptCache) and side.masks is None and side.press is None


def can_share(side: Any) -> bool:
    """Whether a side (an engine ``Side`` at batch 1, before decoding) can take the shared
    prompt path: a plain DynamicCache of full-attention layers and no press acting while
    decoding (head-wise masks set at prefill are fine: every row shares them). Anything
    else keeps its per-row copies."""
    cache = side.cache
    return (type(cache) is DynamicCache and bool(cache.layers)
            and all(type(layer) is DynamicLayer and layer.is_initialized for layer in cache.layers)
            and cache.layers[0].keys.shape[0] == 1
            and all(m is None or m.shape[0] == 1 for m in side.masks or ())
            and side.press is None)


def share_prompt(side: Any, capacity: int) -> bool:
    """Switch a side to the shared prompt path when :func:`can_share` allows; returns
    whether it did. ``capacity``: tokens per row to preallocate (the horizon)."""
    if not can_share(side):
        return False
    side.cache = SharedPromptCache.from_dynamic(side.cache, capacity)
    return True


@contextmanager
def attention_route(model: torch.nn.Module, cache: Any, mask: torch.Tensor | None,
                    positions: torch.Tensor | None = None) -> Iterator[tuple[torch.Tensor | None, dict[str, Any]]]:
    """For one forward: ``(attention_mask, extra model kwargs)``. With a shared prompt
    cache, attention goes through the cascade function (the model's attention setting
    is switched for this forward only) and the mask travels on the cache, as do the
    forward's (rows, n) ``positions`` (a sliding window reads them); otherwise the
    forward is left as it was."""
    if not isinstance(cache, (SharedPromptCache, StackedPromptCache)):
        yield mask, {}
        return
    if positions is not None:
        cache.note_positions(positions)
    config = model.config
    before = config._attn_implementation_internal
    config._attn_implementation_internal = CASCADE
    groups = cache.groups if isinstance(cache, StackedPromptCache) else [cache]
    masks = cache.masks if isinstance(cache, StackedPromptCache) else [mask]
    for group, m in zip(groups, masks, strict=True):
        group.row_mask = m
    try:
        yield None, {CACHE_KWARG: cache}
    finally:
        config._attn_implementation_internal = before
        for group in groups:
            group.row_mask = None
