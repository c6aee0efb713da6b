"""Logits in float32 whatever the weights' dtype: every forward the engine runs goes through :func:`logits`.

On CUDA the weights are bf16, and transformers' causal LMs round the final norm's
output and the output projection's result to bf16; at logits of 8–32 one bf16 step is
6–12 % of a token's probability, which TV would then measure. Here the decoder body
runs as the model's own ``forward`` would run it (``model.model(...)``: every kvpress
hook and patched forward still applies), the final norm is recomputed in float32 from
its (unrounded) input, and the head is ``F.linear`` of that float32 hidden state with a
float32 copy of the head's weight, made once per model (:func:`head32`, built when the
model is loaded; :func:`extra_bytes` is what it costs beyond the weights). A model
already in float32 gets no copy and no extra norm: the same operations on the same
tensors as ``model(...).logits``, bit for bit.

A cached copy rather than casting the weight chunk by chunk at every step: a cast reads
the bf16 weight, writes and reads float32 again (10 bytes per parameter per step
against 4 for the copy, 2 today), and decoding steps are bound by the bytes they read.
The copy costs vocabulary × hidden × 4 bytes once (2.1 GB for Llama-3.1-8B's
128k × 4096 head, 0.4 GB for Llama-3.2-1B's).

Models whose head is not a plain ``nn.Linear`` after a final ``norm`` fall back to the
model's own logits, cast to float32 (logged once).
"""

from __future__ import annotations

import copy
import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger("kvdiv.service")

__all__ = ["Head32", "extra_bytes", "head32", "logits"]


@dataclass(frozen=True)
class Head32:
    """A model's output layer in float32.

    ``weight``/``bias`` are the head's own tensors when they are float32 already (no
    copy); ``norm`` is a float32 copy of the final norm module, or None when the norm is
    float32 already (the decoder's own norm output is then used as is).
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    norm: torch.nn.Module | None
    source: tuple[Any, ...]       # the head weight it was made from (rebuilt when that changes)
    copied_bytes: int             # bytes held beyond the model's weights


_HEADS: weakref.WeakKeyDictionary[torch.nn.Module, Head32 | None] = weakref.WeakKeyDictionary()


def _parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Linear] | None:
    """(decoder body, its final norm, the head), or None where the model is not shaped so."""
    decoder = getattr(model, "model", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    norm = getattr(decoder, "norm", None)
    if decoder is None or not isinstance(head, torch.nn.Linear) or not isinstance(norm, torch.nn.Module):
        return None
    return decoder, norm, head


@torch.no_grad()
def head32(model: torch.nn.Module) -> Head32 | None:
    """The model's float32 head, made on first use and kept (None: the model's own head is used)."""
    parts = _parts(model)
    if parts is None:
        if model not in _HEADS:
            log.warning("%s: no plain linear head after a final norm; logits are the model's own, cast to "
                        "float32", type(model).__name__)
            _HEADS[model] = None
        return None
    _, norm, head = parts
    w = head.weight
    source = (id(w), w.data_ptr(), w.dtype, w.device, _version(w))
    cached = _HEADS.get(model)
    if cached is not None and cached.source == source:
        return cached
    copies = [t for t in (w, head.bias) if t is not None and t.dtype != torch.float32]
    bias = None if head.bias is None else head.bias.detach().float()
    tensors = [t for t in (*norm.parameters(), *norm.buffers()) if t.is_floating_point()]
    norm32 = None
    if any(t.dtype != torch.float32 for t in tensors):
        norm32 = copy.deepcopy(norm).float()
        norm32._forward_hooks.clear()
        norm32._forward_pre_hooks.clear()
        copies += tensors
    made = Head32(weight=w.detach().float(), bias=bias, norm=norm32, source=source,
                  copied_bytes=sum(t.numel() * 4 for t in copies))
    _HEADS[model] = made
    return made


def _version(t: torch.Tensor) -> int | None:
    """The tensor's version counter (an in-place write bumps it); None for an inference
    tensor, which has none."""
    try:
        return t._version
    except RuntimeError:
        return None


def extra_bytes(model: torch.nn.Module) -> int:
    """Bytes the float32 head holds beyond the model's weights (0 for a float32 model)."""
    made = head32(model)
    return 0 if made is None else made.copied_bytes


def _postprocess(config: Any, out: torch.Tensor) -> torch.Tensor:
    """What some causal LMs do to the head's output (Gemma 2/3's soft cap, Cohere's and
    Granite's scales), in float32."""
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is not None:
        out = torch.tanh(out / cap) * cap
    scale = getattr(config, "logit_scale", None)
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        out = out * scale
    scaling = getattr(config, "logits_scaling", None)
    if isinstance(scaling, (int, float)) and not isinstance(scaling, bool):
        out = out / scaling
    return out


def logits(model: torch.nn.Module, logits_to_keep: int = 0, **inputs: Any) -> torch.Tensor:
    """The float32 logits of ``model(**inputs, logits_to_keep=...)`` with the final norm and
    the head computed in float32: (batch, kept positions, vocabulary).

    ``inputs`` are what the causal LM's ``forward`` takes (``input_ids``,
    ``past_key_values``, ``position_ids``, ``attention_mask``, ``use_cache``, attention
    keyword arguments); the decoder body gets them exactly as the causal LM would pass
    them. ``logits_to_keep`` keeps the last positions only (0: all), as in transformers.
    """
    head = head32(model)
    if head is None:
        return model(**inputs, logits_to_keep=logits_to_keep).logits.float()
    decoder, norm, _ = _parts(model)
    hook = None
    if head.norm is not None:
        norm32 = head.norm

        def norm_fp32(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            # the norm again, from its unrounded input, with float32 parameters
            return norm32(args[0].float())

        hook = norm.register_forward_hook(norm_fp32)
    try:
        hidden = decoder(**inputs).last_hidden_state
    finally:
        if hook is not None:
            hook.remove()
    if logits_to_keep:
        hidden = hidden[:, -logits_to_keep:, :]
    out = F.linear(hidden.float(), head.weight, head.bias)
    return _postprocess(model.config, out)
