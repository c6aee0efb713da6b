"""Cascade attention: a prompt shared by every row plus each row's own tokens.

Decoding R rows from one prompt, every row attends to the same prompt keys/values
and to the tokens it generated itself. Storing the prompt once (batch 1) and the
rows' tokens apart, attention splits into two parts merged exactly by log-sum-exp,
as cascade attention (FlashInfer) does:

- over the shared prompt, all rows' queries against one copy of its keys: one
  batch-1 attention per KV head (torch's fused kernel, which also returns the
  log-sum-exp, where it runs) that reads the prompt once per step, not R times;
- over each row's own tokens, a batched product over (rows, heads), masked per row.

With s_1, s_2 the two parts' scores, m_i their maxima, l_i = Σ exp(s_i − m_i) and
o_i = Σ exp(s_i − m_i) v the unnormalised outputs, softmax attention over the
concatenation is (o_1 e^{m_1 − M} + o_2 e^{m_2 − M}) / (l_1 e^{m_1 − M} + l_2 e^{m_2 − M})
with M = max(m_1, m_2): the same numbers as one softmax over all keys, up to rounding.

:func:`cascade_attention_forward` has transformers' attention-function signature and
is registered in ``AttentionInterface`` as :data:`CASCADE`; the cache it reads
(:class:`gen_service.attention.shared_cache.SharedPromptCache`) arrives through the forward's
keyword arguments under :data:`CACHE_KWARG`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gen_service.attention.head_masks import HIDDEN_ATTR

__all__ = ["CACHE_KWARG", "CASCADE", "PLAIN", "ScoreMods", "cascade_attention", "cascade_attention_forward",
           "prompt_kernel", "stacked_cascade_attention"]

CASCADE = "kvdiv_cascade"
CACHE_KWARG = "kvdiv_shared_cache"


@dataclass(frozen=True)
class ScoreMods:
    """What one layer does to its attention beyond softmax(q·kᵀ·scaling), read from what
    the model passes its attention function (so it is the model's own setting, layer by layer).

    ``window``: a key is visible to a query at position p iff p − window < its position ≤ p
    (transformers' sliding window); ``softcap``: scores become cap·tanh(s/cap) (Gemma 2);
    ``sinks``: (q_heads,) one extra logit per head whose value is zero (GPT-OSS), a term of
    the softmax's denominator only; ``q_pos`` (rows, n) and ``row_pos`` (rows, m): the
    positions of the queries and of each row's own slots, needed with a window (the
    prompt's slot i is position i: windowed layers are never compressed).
    """

    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    q_pos: torch.Tensor | None = None
    row_pos: torch.Tensor | None = None

    @property
    def plain(self) -> bool:
        return self.window is None and self.softcap is None and self.sinks is None


PLAIN = ScoreMods()


def _scores(q: torch.Tensor, keys: torch.Tensor, scaling: float, softcap: float | None) -> torch.Tensor:
    """Scaled dot products, soft-capped as the model's eager attention does (float32)."""
    s = torch.matmul(q, keys.transpose(-1, -2)).float() * scaling
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    return s


def _part(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max, Σ exp(s − max), Σ exp(s − max) v) of one part, softmax statistics in float32."""
    s = scores.float()
    m = s.amax(-1, keepdim=True)
    # a row whose keys are all masked has m = −inf: keep its weights at 0, not NaN
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    return m, e.sum(-1, keepdim=True), torch.matmul(e.to(values.dtype), values).float()


# Which kernel computes the prompt part, as a table decided from what is known at load
# (device, dtype, head size, whether keys are masked, whether scores are soft-capped) and
# never changed by an error at run time: a kernel that fails raises, in its request.
#   cpu  any dtype, masked or not, no soft cap      -> "cpu-flash" (mask as an additive bias)
#   cuda fp16/bf16, head_dim <= 256, sm80+, no mask -> "cuda-flash"
#   cuda otherwise unmasked, no soft cap            -> "cuda-efficient"
#   a soft cap, or a mask on CUDA                   -> "explicit" (softmax over the scores)
_CPU_FLASH = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def prompt_kernel(device: torch.device, dtype: torch.dtype, head_dim: int, masked: bool,
                  softcap: bool = False) -> str:
    """The prompt part's kernel for these facts (the table above)."""
    if softcap:
        return "explicit"
    if device.type == "cpu":
        return "cpu-flash" if _CPU_FLASH else "explicit"
    if device.type != "cuda" or masked:
        return "explicit"
    if dtype in (torch.float16, torch.bfloat16) and head_dim <= 256 and _sm80(device):
        return "cuda-flash"
    return "cuda-efficient"


def _sm80(device: torch.device) -> bool:
    """Flash attention's CUDA kernel needs compute capability 8.0 or later."""
    return torch.cuda.get_device_capability(device)[0] >= 8


def _fused_kernel(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                  blocked: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's fused attention kernels that also return the log-sum-exp (B, H, M);
    ``blocked`` (broadcastable to (B, H, M, keys), CPU only) hides keys."""
    if kernel == "cpu-flash":
        bias = None if blocked is None else torch.zeros(
            blocked.shape, dtype=q.dtype, device=q.device).masked_fill(blocked, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias, scale=scaling)[:2]
        if blocked is not None:   # a query whose keys are all hidden: output 0 and log-sum-exp −inf (the kernel says 0)
            none = blocked.all(-1)
            out = torch.nan_to_num(out, nan=0.0)
            lse = lse.masked_fill(none.expand(lse.shape), float("-inf"))
    elif kernel == "cuda-flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scaling)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, scale=scaling)[:2]
    return out, lse[..., :q.shape[-2]]     # the memory-efficient kernel pads M to its block


def _prompt_part(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                 fused: bool = True, hidden: torch.Tensor | None = None, softcap: float | None = None,
                 blocked: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised output (B, H, M, D) and log-sum-exp (B, H, M, 1), float32, of attention
    over the keys not ``hidden`` ((B, H, keys) boolean, per KV head) nor ``blocked``
    ((B, 1, M, keys), per query: a window): torch's fused kernel (no (M, keys) score
    matrix in memory) where :func:`prompt_kernel` says it runs, else the explicit softmax."""
    mask = None if hidden is None else hidden[:, :, None, :]
    if blocked is not None:
        mask = blocked if mask is None else mask | blocked
    kernel = prompt_kernel(q.device, q.dtype, q.shape[-1], mask is not None, softcap is not None) \
        if fused else "explicit"
    if kernel != "explicit":
        out, lse = _fused_kernel(kernel, q, keys, values, scaling, mask)
        return out.float(), lse.float().unsqueeze(-1)
    s = _scores(q, keys, scaling, softcap)
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    m, total, o = _part(s, values)
    total = total.clamp_min(torch.finfo(total.dtype).tiny)   # a head with every key hidden: 0, not NaN
    return o / total, m + total.log()


def _outside_window(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """(…, queries, keys) boolean: keys outside each query's window (or after it)."""
    d = q_pos[..., :, None] - k_pos[..., None, :]
    return (d < 0) | (d >= window)


def _query_positions(mods: ScoreMods, g: int) -> torch.Tensor:
    """(rows, g*n) positions in the cascade's query layout (head j of a KV head, token t)."""
    R, n = mods.q_pos.shape
    return mods.q_pos[:, None, :].expand(R, g, n).reshape(R, g * n)


def cascade_attention(query: torch.Tensor, prompt_keys: torch.Tensor, prompt_values: torch.Tensor,
                      row_keys: torch.Tensor | None, row_values: torch.Tensor | None, scaling: float,
                      row_mask: torch.Tensor | None = None, fused: bool = True,
                      hidden: torch.Tensor | None = None, mods: ScoreMods = PLAIN) -> torch.Tensor:
    """Attention of every row's queries over a shared prompt and the row's own keys.

    Parameters
    ----------
    query : torch.Tensor
        (rows, q_heads, n, head_dim): the n newest tokens of each row; q_heads is a
        multiple of the KV heads (grouped-query attention, head h reads KV head h // g).
    prompt_keys, prompt_values : torch.Tensor
        (1, kv_heads, prompt_slots, head_dim), shared by every row and visible to all.
    row_keys, row_values : torch.Tensor or None
        (rows, kv_heads, m, head_dim): each row's own slots, the last n being the
        queries' own tokens (causal among them); None when no row has any.
    scaling : float
        The softmax temperature (1/√head_dim for most models).
    row_mask : torch.Tensor, optional
        (rows, m) boolean or 0/1: which of a row's own slots it may attend to (a wider
        mask is read from its last m columns).
    fused : bool
        Use torch's fused attention kernel for the prompt part where it runs (default);
        False computes the softmax explicitly (the fallback, also used by tests).
    hidden : torch.Tensor, optional
        (rows, kv_heads, prompt_slots + m) boolean: keys hidden from a KV head's
        queries (head-wise presses such as AdaKV). Every row shares the prompt's part,
        read from the first row; the rows' own part applies per row.
    mods : ScoreMods
        The layer's sliding window, soft cap and sinks (default: none).

    Returns
    -------
    torch.Tensor
        (rows, n, q_heads, head_dim), in the layout transformers' attention
        functions return.

    Examples
    --------
    >>> q, k, v = torch.randn(2, 4, 1, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    >>> cascade_attention(q, k, v, None, None, 8 ** -0.5).shape
    torch.Size([2, 1, 4, 8])
    """
    R, Hq, n, D = query.shape
    Hkv = prompt_keys.shape[1]
    g = Hq // Hkv
    q = query.reshape(R, Hkv, g * n, D)           # head h = kv * g + j, as repeat_kv orders them
    # shared prompt: all rows' queries of a KV head as one batch-1 query block against
    # its one copy of the prompt
    qp = q.transpose(0, 1).reshape(1, Hkv, R * g * n, D)
    L = prompt_keys.shape[-2]
    qpos = None if mods.window is None else _query_positions(mods, g)           # (R, g*n)
    blocked = None if qpos is None else _outside_window(
        qpos.reshape(1, 1, R * g * n), torch.arange(L, device=query.device), mods.window)
    o1, lse1 = _prompt_part(qp, prompt_keys, prompt_values, scaling, fused,
                            None if hidden is None else hidden[:1, :, :L], mods.softcap, blocked)
    o1, lse1 = (t.reshape(Hkv, R, g * n, -1).transpose(0, 1) for t in (o1, lse1))    # (R, Hkv, g*n, ·)
    if row_keys is not None and row_keys.shape[-2] > 0:
        m = row_keys.shape[-2]
        visible = _row_visibility(m, n, g, row_mask, query.device)
        if hidden is not None:
            own = ~hidden[:, :, None, L:L + m]                            # (R, Hkv, 1, m)
            visible = own if visible is None else visible & own
        if qpos is not None:
            inside = ~_outside_window(qpos, mods.row_pos[:, -m:], mods.window)[:, None]   # (R, 1, g*n, m)
            visible = inside if visible is None else visible & inside
        out = _with_rows(q, o1, lse1, row_keys, row_values, visible, scaling, mods, g, n)
    else:
        out = _with_rows(q, o1, lse1, None, None, None, scaling, mods, g, n)
    # (R, Hkv, g*n, D) -> (R, n, Hq, D)
    return out.to(query.dtype).reshape(R, Hq, n, D).transpose(1, 2).contiguous()


def _with_rows(q: torch.Tensor, o1: torch.Tensor, lse1: torch.Tensor, row_keys: torch.Tensor | None,
               row_values: torch.Tensor | None, visible: torch.Tensor | None, scaling: float,
               mods: ScoreMods = PLAIN, g: int = 1, n: int = 1) -> torch.Tensor:
    """The prompt part's (output, log-sum-exp) merged with the rows' own part, whose
    ``visible`` keys (broadcast to (R, Hkv, g*n, m); None: all) each row attends, and
    with the layer's sinks: one more logit per head in the denominator, no value."""
    if row_keys is None:
        m2, l2, o2 = lse1, torch.zeros_like(lse1), torch.zeros_like(o1)
    else:
        s2 = _scores(q, row_keys, scaling, mods.softcap)                  # (R, Hkv, g*n, m)
        if visible is not None:
            s2 = s2.masked_fill(~visible, float("-inf"))
        m2, l2, o2 = _part(s2, row_values)
    # merge: weights relative to the larger of the parts' maxima
    top = torch.maximum(lse1, m2)
    sink = None
    if mods.sinks is not None:
        Hkv = q.shape[1]
        sink = mods.sinks.float().reshape(Hkv, g, 1).expand(Hkv, g, n).reshape(1, Hkv, g * n, 1)
        top = torch.maximum(top, sink)
    a1, a2 = torch.exp(lse1 - top), torch.exp(m2 - top)
    den = a1 + l2 * a2
    if sink is not None:
        den = den + torch.exp(sink - top)
    return (o1 * a1 + o2 * a2) / den


def stacked_cascade_attention(query: torch.Tensor, prompt_keys: torch.Tensor, prompt_values: torch.Tensor,
                              pad: torch.Tensor | None, row_keys: torch.Tensor, row_values: torch.Tensor,
                              visible: torch.Tensor | None, scaling: float, widest: int,
                              row_group: torch.Tensor | None = None, row_index: torch.Tensor | None = None,
                              fused: bool = True, mods: ScoreMods = PLAIN) -> torch.Tensor:
    """:func:`cascade_attention` for G groups in one call per part: the op count does not
    grow with G.

    Parameters
    ----------
    query : torch.Tensor
        (rows, q_heads, 1, head_dim), the groups' rows in order (one new token each).
    prompt_keys, prompt_values : torch.Tensor
        (G, kv_heads, L_max, head_dim): group g's prompt in its first slots.
    pad : torch.Tensor or None
        (G, 1, L_max) boolean, the padding slots of shorter prompts (None: none).
    row_keys, row_values : torch.Tensor
        (rows, kv_heads, m, head_dim): every row's own slots (the new token's included).
    visible : torch.Tensor or None
        (rows, 1, 1, m) boolean: the own slots each row attends (None: all m).
    scaling : float
        The softmax temperature.
    widest : int
        The largest group's rows; every group has that many when ``row_group`` is None.
    row_group, row_index : torch.Tensor, optional
        (rows,) long: each row's group and its index in it, when the groups' row counts
        differ (their query blocks are then padded to ``widest`` rows).
    fused : bool
        Use torch's fused kernel for the prompt part where it runs.
    mods : ScoreMods
        The layer's window (``q_pos`` (rows, 1), ``row_pos`` (rows, m)), soft cap and sinks.

    Returns
    -------
    torch.Tensor
        (rows, 1, q_heads, head_dim).

    Examples
    --------
    >>> q = torch.randn(4, 4, 1, 8)
    >>> pk, pv = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    >>> rk, rv = torch.randn(4, 2, 3, 8), torch.randn(4, 2, 3, 8)
    >>> out = stacked_cascade_attention(q, pk, pv, None, rk, rv, None, 8 ** -0.5, widest=2)
    >>> alone = cascade_attention(q[2:], pk[1:], pv[1:], rk[2:], rv[2:], 8 ** -0.5)
    >>> bool(torch.allclose(out[2:], alone, atol=1e-5))
    True
    """
    N, Hq, n, D = query.shape
    G, Hkv = prompt_keys.shape[:2]
    g = Hq // Hkv
    q = query.reshape(N, Hkv, g, D)
    # each group's queries of a KV head as one query block against its own prompt:
    # (G, widest, Hkv, g, D) -> (G, Hkv, widest * g, D)
    if row_group is None:
        blocks = q.reshape(G, widest, Hkv, g, D)
    else:
        blocks = q.new_zeros(G, widest, Hkv, g, D)
        blocks[row_group, row_index] = q
    qp = blocks.transpose(1, 2).reshape(G, Hkv, widest * g, D)
    blocked = None
    if mods.window is not None:      # each query block's positions (padding rows: position 0)
        qpos = mods.q_pos[:, -1]
        if row_group is None:
            bpos = qpos.reshape(G, widest)
        else:
            bpos = qpos.new_zeros(G, widest)
            bpos[row_group, row_index] = qpos
        bpos = bpos[:, :, None].expand(G, widest, g).reshape(G, 1, widest * g)
        blocked = _outside_window(bpos, torch.arange(prompt_keys.shape[-2], device=query.device), mods.window)
        inside = ~_outside_window(qpos[:, None], mods.row_pos, mods.window)[:, None]    # (rows, 1, 1, m)
        visible = inside if visible is None else visible & inside
    o1, lse1 = _prompt_part(qp, prompt_keys, prompt_values, scaling, fused, pad, mods.softcap, blocked)
    o1, lse1 = (t.reshape(G, Hkv, widest, g, -1).transpose(1, 2) for t in (o1, lse1))   # (G, widest, Hkv, g, ·)
    if row_group is None:
        o1, lse1 = o1.reshape(N, Hkv, g, -1), lse1.reshape(N, Hkv, g, 1)
    else:
        o1, lse1 = o1[row_group, row_index], lse1[row_group, row_index]
    out = _with_rows(q, o1, lse1, row_keys, row_values, visible, scaling, mods, g, 1)
    return out.to(query.dtype).reshape(N, Hq, 1, D).transpose(1, 2).contiguous()


def _row_visibility(m: int, n: int, g: int, row_mask: torch.Tensor | None,
                    device: torch.device) -> torch.Tensor | None:
    """(rows or 1, 1, g*n, m) boolean: causal among the n new tokens, and the row mask."""
    visible = None
    if n > 1:
        slot = torch.arange(m, device=device)
        qpos = (m - n) + torch.arange(n, device=device)
        causal = slot[None, :] <= qpos[:, None]                           # (n, m)
        visible = causal.repeat(g, 1)[None, None]                         # (1, 1, g*n, m)
    if row_mask is not None:
        rm = row_mask[:, -m:].bool()[:, None, None, :]                    # (R, 1, 1, m)
        visible = rm if visible is None else visible & rm
    return visible


def cascade_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: torch.Tensor | None,
                              dropout: float = 0.0, scaling: float | None = None,
                              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function form of :func:`cascade_attention`.

    ``key``/``value`` are the rows' own slots, as the shared cache's ``update``
    returned them; the prompt and the per-row mask come from the cache passed to the
    forward as ``kvdiv_shared_cache``. A stacked cache (several groups in one batch,
    its ``groups`` and ``bounds``) is attended in one call per layer over its pooled
    buffers (:func:`stacked_cascade_attention`), each group's rows over its own prompt
    and slots; or group by group (``STACKED_ATTENTION = "loop"``). ``attention_mask`` is unused (the shared cache
    carries the mask over its rows' own slots; head-wise presses' masks come from the
    module, as gen_service.attention.head_masks leaves them for one forward). The argument order is
    transformers' SDPA function's: kvpress's attention patch passes ``dropout``
    positionally when it wraps the registered functions.

    Raises
    ------
    RuntimeError
        When called without a shared cache (the route was set but the cache not passed).
    """
    cache = kwargs.get(CACHE_KWARG)
    if cache is None:
        raise RuntimeError(f"{CASCADE} attention needs the shared prompt cache as `{CACHE_KWARG}`")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    hidden = getattr(module, HIDDEN_ATTR, None)
    groups = getattr(cache, "groups", None)
    idx = module.layer_idx
    window, softcap, sinks = kwargs.get("sliding_window"), kwargs.get("softcap"), kwargs.get("s_aux")
    if groups is None:
        layer = cache.layers[idx]
        mods = _mods(window, softcap, sinks, cache, [cache], idx, key.shape[-2])
        return cascade_attention(query, layer.prompt_keys, layer.prompt_values, key, value, scaling, cache.row_mask,
                                 hidden=hidden, mods=mods), None
    # several groups stacked in one batch (gen_service.attention.shared_cache.StackedPromptCache)
    layer = cache.layers[idx]
    if layer.pool is not None:    # every group in one call, over the pooled buffers
        pool = layer.pool
        mods = _mods(window, softcap, sinks, cache, groups, idx, cache.seen)
        return stacked_cascade_attention(query, pool.prompt_keys, pool.prompt_values, pool.pad,
                                         pool.row_keys[:, :, :cache.seen], pool.row_values[:, :, :cache.seen],
                                         cache.visible, scaling, cache.widest, cache.row_group,
                                         cache.row_index, mods=mods), None
    # group by group: each group's queries over its own prompt and rows, as its own forward would
    outs = []
    for group, (a, b) in zip(groups, cache.bounds, strict=True):
        layer = group.layers[idx]
        mods = _mods(window, softcap, sinks, group, [group], idx, layer.filled)
        outs.append(cascade_attention(query[a:b], layer.prompt_keys, layer.prompt_values,
                                      layer.row_keys[:, :, :layer.filled], layer.row_values[:, :, :layer.filled],
                                      scaling, group.row_mask, hidden=None, mods=mods))
    return torch.cat(outs), None


def _mods(window: int | None, softcap: float | None, sinks: torch.Tensor | None, cache: Any, groups: list[Any],
          idx: int, m: int) -> ScoreMods:
    """The layer's :class:`ScoreMods` for this forward, positions from the cache (``cache``:
    the one being attended, whose ``q_pos``/``row_pos`` hold this forward's positions;
    ``groups``: the shared caches whose prompts the layer reads)."""
    if window is None and softcap is None and sinks is None:
        return PLAIN
    if window is None:
        return ScoreMods(softcap=softcap, sinks=sinks)
    for group in groups:
        slots = group.layers[idx].prompt_keys.shape[-2]
        if slots != group.prompt_len:
            # slot i is position i only in a layer kept whole: never guess positions
            raise RuntimeError(f"layer {idx} has a sliding window of {window} but its prompt cache was compressed "
                               f"({slots} of {group.prompt_len} slots); windowed layers must be left as the model "
                               "keeps them (gen_service.presses.layered)")
    return ScoreMods(window=int(window), softcap=softcap, sinks=sinks, q_pos=cache.q_pos,
                     row_pos=cache.row_positions(m))
