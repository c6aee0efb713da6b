"""One compression rule for models with sliding-window layers, whatever the model class.

kvpress's own rule for Gemma 3 (``BasePress.__call__``, for ``Gemma3ForConditionalGeneration``
only) is to compress the global layers and leave the windowed ones as the model keeps
them; on ``Gemma3ForCausalLM``, Mistral, Qwen 2/3 with windows, GPT-OSS, Cohere 2 or OLMo 3
it hooks every layer. Here the rule holds for every model: :func:`press_applied` enters
the press's own context (whatever its class does there), then takes the hooks it put on
windowed layers off again, so those layers keep every slot (slot i is then position i,
which the cascade's window reads: gen_service.attention.cascade). A model whose every layer is
windowed (Mistral, Phi-3 with a window) is therefore left uncompressed, and the trace
header says so (``compressed_layers: []``, ``cache_retention: 1``).

kvpress points every hooked layer's ``rotary_emb`` at the decoder's one rotary embedding
and re-rotating presses read its ``inv_freq``. Gemma 3's has none (one per layer type),
and Cohere 2's global layers use no rotary embedding at all; each compressed layer gets
its own (:class:`LayerRotary`): its type's frequencies, or zero frequencies (the
identity rotation) for a layer without one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from gen_service.attention.plan import layer_windows
from gen_service.presses.rotary import install as install_window_attention

__all__ = ["LayerRotary", "compressible_layers", "decoding_hooks", "press_applied", "rotary_free"]


def compressible_layers(model: torch.nn.Module) -> list[int]:
    """The layers a press may compress: those without a sliding window."""
    return [i for i, w in enumerate(layer_windows(model.config)) if w is None]


def rotary_free(model: torch.nn.Module, idx: int) -> bool:
    """Whether layer ``idx`` applies no rotary embedding (Cohere 2's global layers,
    SmolLM3's and Llama 4's NoPE layers)."""
    config = model.config
    attn = model.model.layers[idx].self_attn
    if getattr(attn, "use_rope", True) is False:
        return True
    no_rope = getattr(config, "no_rope_layers", None)
    if no_rope is not None and not no_rope[idx]:
        return True
    return getattr(config, "model_type", "") == "cohere2" and layer_windows(config)[idx] is None


class LayerRotary(torch.nn.Module):
    """One layer's rotary embedding as kvpress's re-rotating presses read it: ``inv_freq``
    and ``(x, position_ids) -> (cos, sin)``.

    Parameters
    ----------
    rotary : torch.nn.Module
        The decoder's rotary embedding.
    layer_type : str or None
        The layer's type where the embedding keeps one set of frequencies per type
        (``full_attention_inv_freq``, Gemma 3); None: its ``inv_freq``.
    identity : bool
        A layer without rotary embedding: zero frequencies (cos 1, sin 0).
    """

    def __init__(self, rotary: torch.nn.Module, layer_type: str | None, identity: bool = False):
        super().__init__()
        self.rotary, self.layer_type, self.identity = rotary, layer_type, identity
        freq = getattr(rotary, f"{layer_type}_inv_freq") if layer_type else rotary.inv_freq
        self.inv_freq = torch.zeros_like(freq) if identity else freq

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.identity:
            shape = (*position_ids.shape, 2 * self.inv_freq.shape[0])
            return torch.ones(shape, dtype=x.dtype, device=x.device), torch.zeros(shape, dtype=x.dtype, device=x.device)
        if self.layer_type:
            return self.rotary(x, position_ids, self.layer_type)
        return self.rotary(x, position_ids)


def _layer_rotary(model: torch.nn.Module, idx: int) -> LayerRotary | None:
    rotary = getattr(model.model, "rotary_emb", None)
    if rotary is None:
        return None
    types = getattr(model.config, "layer_types", None)
    per_type = types is not None and hasattr(rotary, f"{types[idx]}_inv_freq")
    return LayerRotary(rotary, types[idx] if per_type else None, rotary_free(model, idx))


@contextmanager
def press_applied(press: Any, model: torch.nn.Module) -> Iterator[None]:
    """``with press(model)`` under the layered rule: the press's own context, its hooks
    kept on the compressible layers only, each of those with its own rotary embedding
    (and kvpress's window attention rotating queries as the model does: :mod:`gen_service.presses.rotary`)."""
    install_window_attention()
    attns = [layer.self_attn for layer in model.model.layers]
    keep = set(compressible_layers(model))
    before = [dict(a._forward_hooks) for a in attns]
    rotaries = [a.__dict__.get("rotary_emb", a._modules.get("rotary_emb")) for a in attns]
    with press(model):
        for i, a in enumerate(attns):
            if i not in keep:     # the press's hooks on a windowed layer: taken off
                for hid in [h for h in a._forward_hooks if h not in before[i]]:
                    a._forward_hooks.pop(hid, None)
                    a._forward_hooks_with_kwargs.pop(hid, None)
            elif "rotary_emb" in a.__dict__ or "rotary_emb" in a._modules:
                own = _layer_rotary(model, i)
                if own is not None:
                    a.rotary_emb = own
        try:
            yield
        finally:
            for a, r in zip(attns, rotaries, strict=True):
                if r is None:
                    a.__dict__.pop("rotary_emb", None)
                    a._modules.pop("rotary_emb", None)
                else:
                    a.rotary_emb = r


def decoding_hooks(press: Any, model: torch.nn.Module) -> list[Any]:
    """A decoding press's hooks on the compressible layers' attention (the handles)."""
    install_window_attention()
    attns = [layer.self_attn for layer in model.model.layers]
    return [attns[i].register_forward_hook(press.forward_hook, with_kwargs=True) for i in compressible_layers(model)]
