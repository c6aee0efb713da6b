"""kvpress's window attention with the model's own rotary embedding.

SnapKV and the presses that score with its window attention (PyramidKV, AdaKV, ChunkKV,
CriticalKV, TOVA, Finch, SimLayerKV ...) call ``SnapKVPress.compute_window_attention``:
the last ``window_size`` queries, rotated, against the cached keys. kvpress rotates the
queries with Llama's formula at the full head width, ``q * cos + rotate_half(q) * sin``,
which assumes cos/sin as wide as the head. Two families' rotary embeddings are narrower:

* Phi-3 with ``partial_rotary_factor < 1`` rotates only the first ``rotary_dim`` channels
  of each head and passes the rest through;
* GPT-OSS gives cos/sin of half the head and rotates the two halves against each other.

There kvpress fails ("The size of tensor a (16) must match the size of tensor b (8)").
:func:`window_attention` rotates the queries as the model's attention does, with its own
module's ``apply_rotary_pos_emb``, and is otherwise kvpress's function line for line;
where cos/sin are as wide as the head it *is* kvpress's function (it calls it), so every
full-rotary model scores exactly as kvpress scores it. tests/test_presses_families.py checks
that the model's-own-rotary path equals kvpress's bit for bit on the full-rotary families,
and that every window-attention press runs on partial rotary.

:func:`install` puts it in place of kvpress's (once per process; the press adapter,
:mod:`gen_service.presses.layered`, calls it before a press is applied).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["install", "kvpress_window_attention", "model_rotary_window_attention", "window_attention"]

_ORIGINAL: list[Callable[..., torch.Tensor]] = []


def kvpress_window_attention() -> Callable[..., torch.Tensor]:
    """kvpress's own ``SnapKVPress.compute_window_attention`` (before :func:`install`)."""
    if not _ORIGINAL:
        from kvpress import SnapKVPress

        _ORIGINAL.append(SnapKVPress.__dict__["compute_window_attention"].__func__)
    return _ORIGINAL[0]


def _rotate_as_model(module: nn.Module, query: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The queries rotated by the model's own ``apply_rotary_pos_emb`` (its module's)."""
    apply = getattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb", None)
    if apply is None:
        raise NotImplementedError(f"{type(module).__name__}: its module has no apply_rotary_pos_emb")
    return apply(query, query, cos, sin, unsqueeze_dim=1)[0]


def model_rotary_window_attention(module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor,
                                  window_size: int, position_embeddings: tuple[torch.Tensor, torch.Tensor]
                                  ) -> torch.Tensor:
    """kvpress's window attention (kvpress/presses/snapkv_press.py), its queries rotated as
    the model rotates them: the attention weights of the last ``window_size`` queries on
    the first ``k_len - window_size`` keys, (batch, heads, window, k_len - window)."""
    from kvpress.utils import get_prerope_query_states
    from transformers.models.llama.modeling_llama import repeat_kv

    _, _, k_len, _ = keys.shape
    num_heads = module.config.num_attention_heads
    head_dim = module.head_dim
    num_key_value_groups = num_heads // module.config.num_key_value_heads
    query_states = get_prerope_query_states(module, hidden_states[:, -window_size:])
    cos, sin = position_embeddings
    query_states = _rotate_as_model(module, query_states, cos[:, -window_size:], sin[:, -window_size:])
    key_states = repeat_kv(keys, num_key_value_groups)
    attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(head_dim)
    attention_mask = torch.ones_like(attn_weights) * float("-inf")
    attention_mask = torch.triu(attention_mask, diagonal=k_len - window_size + 1)
    attn_weights += attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
    return attn_weights[..., :-window_size]


def window_attention(module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, window_size: int,
                     position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``SnapKVPress.compute_window_attention`` for every rotary width: kvpress's own where
    cos/sin are as wide as the head, :func:`model_rotary_window_attention` where narrower."""
    if position_embeddings[0].shape[-1] == module.head_dim:
        return kvpress_window_attention()(module, hidden_states, keys, window_size, position_embeddings)
    return model_rotary_window_attention(module, hidden_states, keys, window_size, position_embeddings)


def install() -> None:
    """Put :func:`window_attention` in place of kvpress's (idempotent)."""
    from kvpress import SnapKVPress

    kvpress_window_attention()
    if SnapKVPress.__dict__["compute_window_attention"].__func__ is not window_attention:
        SnapKVPress.compute_window_attention = staticmethod(window_attention)
