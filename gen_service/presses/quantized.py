"""KIVI-style quantized KV caches as candidates (``quant:kivi@2``, ``snapkv@0.5+quant:kivi@4``).

transformers' ``QuantizedCache`` (KIVI, arXiv 2402.02750) keeps each layer's cache in
two parts: a quantized part and a full-precision *residual* of the most recent tokens.
Prefill quantizes the whole prompt (the prefill forward itself attends in full
precision); each decoding step attends to dequantize(quantized part) + residual + the
new token, then appends the new token to the residual, except when the residual then
holds ``residual_length`` tokens: the whole cache (dequantized part + residual + new)
is quantized again and the residual emptied.

What the model sees is the *dequantized* part. :class:`FakeQuantizedLayer` is
transformers' own ``QuantizedLayer`` (its ``update`` runs unchanged, so prefill,
residual and flush are exactly transformers') whose quantizer returns the dequantized
tensor directly (quantize -> dequantize, "fake quantization") and applies per row, so
R replicates decode as R batch-1 caches would. The quantizer is optimum-quanto's
arithmetic (``MaxOptimizer`` min-max scale and shift, ``quantize_affine`` rounding,
``QBitsDequantizer``), in plain torch: no compiled extension and no packing (packing is
lossless and would change nothing the model sees). Axes follow quanto: ``token``
(quanto axis 0) groups ``group_size`` consecutive channels of one token, ``channel``
(quanto axis -1) groups ``group_size`` consecutive tokens of one channel, tokens
counted over heads then positions as quanto flattens them. KIVI quantizes keys per
channel and values per token: the defaults. Where quanto needs ``group_size`` to divide
the number of grouped items, the last group here is simply shorter; with a size that
divides, the values are quanto's.

A press combined with quantization (``+quant:``) compresses through kvpress's own
``QuantizedCache`` path (:class:`FakeQuantizedCache` is a ``QuantizedCache``): the press
scores the dequantized prompt and its kept tokens are quantized again, as kvpress's
pipeline does with a quantized cache. Quantization acts while decoding, so residual
branches are replayed (the engine's replay path) to continue from Q's true state.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, QuantizedCache, QuantizedLayer

from gen_service.presses.kivi import AXES, BITS, KIVIConfig

__all__ = ["AXES", "BITS", "KIVIConfig", "FakeQuantizedCache", "FakeQuantizedLayer", "fake_quantize", "is_quantized",
           "kivi_cache"]

# BITS, AXES and KIVIConfig live in gen_service.presses.kivi (torch-free: the registry checks ids
# with them); re-exported here, where the caches that use them are.


def fake_quantize(x: torch.Tensor, bits: int, group_size: int, axis: str) -> torch.Tensor:
    """Quantize then dequantize ``x`` (rows, heads, tokens, head_dim), each row on its own.

    Parameters
    ----------
    x : torch.Tensor
        Keys or values, batch first.
    bits : int
        2 or 4: values are rounded to ``2**bits`` levels between each group's min and max.
    group_size : int
        Items per group (each group has its own scale and shift).
    axis : str
        ``"token"``: groups of consecutive channels of one token (quanto axis 0);
        ``"channel"``: groups of consecutive tokens of one channel (quanto axis -1),
        tokens taken over (heads, positions) in that order.

    Returns
    -------
    torch.Tensor
        Same shape and dtype: what a model reading the quantized cache sees.

    Examples
    --------
    >>> x = torch.arange(8.0).reshape(1, 1, 2, 4)
    >>> fake_quantize(x, 2, 4, "token")[0, 0, 0].tolist()
    [0.0, 1.0, 2.0, 3.0]
    """
    rows = x.shape[0]
    if axis == "token":
        flat = x.reshape(rows, -1, 1)                        # (rows, items, 1)
    else:
        flat = x.reshape(rows, -1, x.shape[-1])              # (rows, heads*tokens, channels)
    n = flat.shape[1]
    pad = -n % group_size
    if pad:  # repeat the last item: the last group's min and max stay its own
        flat = torch.cat([flat, flat[:, -1:].expand(rows, pad, flat.shape[2])], 1)
    g = flat.reshape(rows, -1, group_size, flat.shape[2])    # (rows, groups, group_size, ·)
    rmin = g.amin(2, keepdim=True)
    rmax = g.amax(2, keepdim=True)
    # quanto: scale = (rmax - rmin) / (qmax - qmin), shift = -rmin,
    # data = clamp(round((x + shift) / scale)), dequantized = scale * data - shift
    scale = (rmax - rmin) / (2**bits - 1)
    shift = -rmin
    data = torch.clamp(torch.round((g + shift) / scale), min=0, max=2**bits - 1).to(torch.uint8)
    data = torch.where(scale == 0, torch.zeros_like(data), data)   # a constant group: 0/0, take level 0
    out = scale * data
    out -= shift
    out = out.reshape(rows, -1, flat.shape[2])[:, :n]
    return out.reshape(x.shape)


class FakeQuantizedLayer(QuantizedLayer):
    """transformers' ``QuantizedLayer`` whose quantized part is stored dequantized.

    Its ``update`` (prefill, residual, flush) is transformers' own; ``_quantize``
    returns :func:`fake_quantize` of the tensor and ``_dequantize`` returns it as is.
    """

    def __init__(self, config: KIVIConfig):
        super().__init__(nbits=config.bits, axis_key=AXES[config.key_axis], axis_value=AXES[config.value_axis],
                         q_group_size=config.group_size, residual_length=config.residual_length)
        self._axis_names = {v: k for k, v in AXES.items()}

    def _quantize(self, tensor: torch.Tensor, axis: int) -> torch.Tensor:
        return fake_quantize(tensor, self.nbits, self.q_group_size, self._axis_names[axis])

    def _dequantize(self, q_tensor: torch.Tensor) -> torch.Tensor:
        return q_tensor

    # rows: the quantized part is batch first too
    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rows(lambda t: t[indices, ...])

    def _rows(self, fn: Any) -> None:
        if not self.is_initialized:
            return
        self._quantized_keys, self._quantized_values = fn(self._quantized_keys), fn(self._quantized_values)
        if self.keys.dim() == 4:   # the residual (an empty 1-D tensor when flushed)
            self.keys, self.values = fn(self.keys), fn(self.values)

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("a quantized cache is not cropped: its branches are replayed")


class FakeQuantizedCache(QuantizedCache):
    """A ``QuantizedCache`` of :class:`FakeQuantizedLayer` (kvpress's presses recognise
    it as quantized and compress through dequantize -> compress -> quantize)."""

    def __init__(self, layers: list[FakeQuantizedLayer]):
        Cache.__init__(self, layers=layers)


def is_quantized(cache: Any) -> bool:
    """Whether ``cache`` quantizes while decoding (its branches cannot be prefixes)."""
    return isinstance(cache, QuantizedCache)


def kivi_cache(config: KIVIConfig, num_layers: int) -> FakeQuantizedCache:
    """An empty quantized cache of ``config``'s settings for a model of ``num_layers`` layers
    (here, not on the torch-free :class:`KIVIConfig`, which the registry imports)."""
    return FakeQuantizedCache([FakeQuantizedLayer(config) for _ in range(num_layers)])
