"""Per-head key masks for head-wise presses (AdaKV, CriticalAdaKV, DMS...).

kvpress marks the keys a head-wise press evicts in ``module.masked_key_indices`` and
its patched attention overwrites them with a "fake key" whose logit underflows. That
cannot hide anything from a query that is exactly zero (every key then scores 0), which
a random model's padding embedding produces. The engine therefore takes the indices
off the module after prefill and hides the keys itself: a wrapper around the SDPA
attention function turns the boolean (rows, kv_heads, slots) mask that the engine sets
on a module, for one forward of one side, into SDPA's boolean attention mask.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["HIDDEN_ATTR", "install", "indices_to_mask", "pad"]

HIDDEN_ATTR = "kvdiv_hidden_keys"   # set on an attention module for one forward only


def pad(mask: torch.Tensor, n: int) -> torch.Tensor:
    """A (rows, heads, slots) mask cut or widened with visible slots to ``n`` slots."""
    if mask.shape[-1] >= n:
        return mask[..., :n]
    extra = torch.zeros(*mask.shape[:-1], n - mask.shape[-1], dtype=torch.bool, device=mask.device)
    return torch.cat([mask, extra], -1)


def indices_to_mask(idx: Any, rows: int, heads: int, slots: int) -> torch.Tensor:
    """kvpress's (batch, head, slot) index tensors -> a boolean (rows, heads, slots) mask."""
    b, h, s = idx
    dev = s.device
    n = max(slots, int(s.max()) + 1 if s.numel() else 0)
    mask = torch.zeros(rows, heads, n, dtype=torch.bool, device=dev)
    mask[b.to(dev), h.to(dev), s] = True
    return mask


def _attention_mask(hidden: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                    attention_mask: torch.Tensor | None) -> torch.Tensor:
    q_len, k_len = query.shape[2], key.shape[2]
    hide = pad(hidden, k_len).repeat_interleave(query.shape[1] // key.shape[1], 1)[:, :, None, :]
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        return attention_mask.masked_fill(hide, torch.finfo(attention_mask.dtype).min)
    allowed = ~hide
    if attention_mask is not None:
        return allowed & attention_mask
    if q_len > 1:  # no mask given means causal: keep it causal
        pos = torch.arange(k_len, device=key.device)
        causal = pos[None] <= (k_len - q_len + torch.arange(q_len, device=key.device))[:, None]
        allowed = allowed & causal
    return allowed


def _wrap(func: Any) -> Any:
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        hidden = getattr(module, HIDDEN_ATTR, None)
        if hidden is not None:
            attention_mask = _attention_mask(hidden, query, key, attention_mask)
        return func(module, query, key, value, attention_mask, *args, **kwargs)

    attention.kvdiv_head_masks = True
    return attention


def install() -> None:
    """Wrap the SDPA attention function once (idempotent). Modules without the
    attribute are untouched, so the reference's forwards run exactly as before."""
    import kvpress  # noqa: F401  (kvpress patches the same registry on import: wrap after it)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    func = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if not getattr(func, "kvdiv_head_masks", False):
        ALL_ATTENTION_FUNCTIONS["sdpa"] = _wrap(func)
