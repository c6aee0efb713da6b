"""Logits in float32 whatever the weights' dtype: every forward the engine runs goes through :func:`logits`.

On CUDA the weights are bf16, and transformers' causal LMs round the final norm's
output and the output projection's result to bf16; at logits of 8–32 one bf16 step is
6–12 % of a token's probability, which TV would then measure. Here the decoder body
runs as the model's own ``forward`` would run it (``model.model(...)``: every kvpress
hook and patched forward still applies), the final norm is recomputed in float32 from
its (unrounded) input, and the head multiplies that float32 hidden state by the
head's own bf16 weight with float32 products, accumulation and output, without a
float32 copy of the weight (2.1 GB for Llama-3.1-8B's 128k × 4096 head, 0.4 GB for
Llama-3.2-1B's). A bf16 value is exactly a float32 value, so that is the float32
product of the same numbers; two ways compute it, the one used decided when the model
is loaded (:func:`head32`, logged, ``Head32.method``):

- ``"split"`` (CUDA, where ``torch.mm`` takes ``out_dtype``): the float32 hidden state
  is written exactly enough as the sum of three bf16 parts (hi + mid + lo: 24
  significant bits, float32's), the three stacked as rows of one bf16 GEMM with
  float32 accumulation and output, and the three results added in float32. The
  weight is read once, at 2 bytes per parameter, as by the bf16 head; the rows triple
  (decoding has tens to hundreds of rows: the GEMM stays bound by reading the weight).
  ``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False`` alone
  would not do: the GEMM's output would still be rounded to bf16. At load it is
  checked against the chunked product on a slice of the head; a mismatch or an error
  falls back to ``"chunked"``, logged;
- ``"chunked"`` (CPU, and CUDA without ``out_dtype``): the weight is cast to float32
  :data:`CHUNK_BYTES` at a time into one reusable buffer and each chunk multiplied in
  float32 (10 bytes moved per parameter and step against 2; on CPU, where no bf16
  GEMM with float32 output exists, the only exact way).

Where a float32 product runs on the CPU (``"float32"`` and ``"chunked"``), it is taken
with the weight as the left operand, ``(W · xᵀ)ᵀ`` (``Head32.layout == "columns"``),
not as ``F.linear`` takes it, ``x · Wᵀ`` (``"rows"``): the same products, summed by the
same kernel family, but oneMKL then packs the few hidden-state rows instead of the whole
weight at every call. On the 2-core development CPU, Gemma 3's 262,144 × 640 head over
16, 28 and 64 rows took 172, 276 and 494 ms against 401, 464 and 697 ms, and the same at
2 rows (padded to 16, below; ``benchmarks/bench_head_draws.py``). A product in this layout always has at least
:data:`MIN_COLUMNS` columns (zero rows added below that): with fewer than 12, oneMKL sums
a column differently depending on how many there are; from 12 on, identically wherever
the column sits (320 × 64, 49,152 × 576 and 65,536 × 640 heads, 1–100 columns at
several offsets), so a request's logits do not depend on its batch-mates
(tests/test_batch_invariance.py). CUDA keeps ``"rows"`` (cuBLAS takes either operand
transposed at no cost).

TF32 was not chosen: it needs float32 weights (the copy) and rounds the hidden state's
mantissa to 10 bits. :func:`extra_bytes` is what the head holds beyond the weights
(the buffer and a float32 copy of the final norm). A model already in float32 gets no
buffer and no extra norm: the same operations on the same tensors as
``model(...).logits`` (``"float32"``): bit for bit in the ``"rows"`` layout, within
float32 rounding of the product in ``"columns"``.

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

from gen_service.models.row_padding import at_least

log = logging.getLogger("kvdiv.service")

__all__ = ["CHUNK_BYTES", "Head32", "advance", "extra_bytes", "head32", "layout_for", "logits", "project"]

#: the float32 buffer the chunked head casts the weight into, a chunk of rows at a time
#: (64 MiB: 4,096 rows of a 4,096-wide head, 32 chunks for 128k tokens; fewer, larger
#: chunks launch fewer kernels, smaller ones hold less)
CHUNK_BYTES = 64 << 20
#: rows of hidden states per split GEMM (its float32 output is 3 × rows × vocabulary)
SPLIT_ROWS = 1024
#: the fewest hidden-state rows a "columns" product takes (zero rows added; see the module)
MIN_COLUMNS = 16
#: hidden-state rows per "columns" product (its transposed output is V × this, copied out)
COLUMN_BLOCK = 256


@dataclass(frozen=True)
class Head32:
    """A model's output layer computed in float32.

    ``weight`` is the head's own weight (no copy), ``bias`` the bias in float32;
    ``norm`` is a float32 copy of the final norm module, or None when the norm is float32
    already (the decoder's own norm output is then used as is). ``method`` says how the
    product is computed: ``"float32"`` (float32 weights: ``F.linear`` as the model does),
    ``"split"`` or ``"chunked"`` (see the module); ``buffer`` is the chunked method's
    float32 buffer (None otherwise).
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    norm: torch.nn.Module | None
    source: tuple[Any, ...]       # the head weight it was made from (rebuilt when that changes)
    copied_bytes: int             # bytes held beyond the model's weights
    method: str = "float32"
    buffer: torch.Tensor | None = None
    #: ``"rows"`` (x · Wᵀ, as ``F.linear``) or ``"columns"`` ((W · xᵀ)ᵀ, the CPU's; see the module)
    layout: str = "rows"


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
    bias = None if head.bias is None else head.bias.detach().float()
    copies = [head.bias] if head.bias is not None and head.bias.dtype != torch.float32 else []
    tensors = [t for t in (*norm.parameters(), *norm.buffers()) if t.is_floating_point()]
    norm32 = None
    if any(t.dtype != torch.float32 for t in tensors):
        norm32 = copy.deepcopy(norm).float()
        norm32._forward_hooks.clear()
        norm32._forward_pre_hooks.clear()
        copies += tensors
    copied = sum(t.numel() * 4 for t in copies)
    if w.dtype == torch.float32:
        made = Head32(weight=w.detach(), bias=bias, norm=norm32, source=source, copied_bytes=copied,
                      layout=layout_for("float32", w.device))
    else:
        method, buffer = _choose(w.detach(), bias)
        made = Head32(weight=w.detach(), bias=bias, norm=norm32, source=source, method=method, buffer=buffer,
                      copied_bytes=copied + (0 if buffer is None else buffer.numel() * 4),
                      layout=layout_for(method, w.device))
        log.info("float32 logits from the %s head: %s product, %s layout (%.1f MiB held beyond the weights; a "
                 "float32 copy would hold %.1f MiB)", w.dtype, method, made.layout, made.copied_bytes / 2**20,
                 w.numel() * 4 / 2**20)
    _HEADS[model] = made
    return made


def layout_for(method: str, device: torch.device) -> str:
    """The product's layout for a head ``method`` on ``device``: ``"columns"`` for the
    float32 products on the CPU (faster there, see the module), ``"rows"`` otherwise."""
    return "columns" if device.type == "cpu" and method in ("float32", "chunked") else "rows"


def _buffer(w: torch.Tensor) -> torch.Tensor:
    """The chunked head's float32 buffer: :data:`CHUNK_BYTES` of ``w``'s rows at most.
    A normal tensor even when made under inference mode (it is written in place by
    calls outside it too)."""
    rows = max(1, min(w.shape[0], CHUNK_BYTES // (4 * w.shape[1])))
    with torch.inference_mode(False):
        return torch.empty(rows, w.shape[1], dtype=torch.float32, device=w.device)


def _splittable(w: torch.Tensor) -> bool:
    """Whether this torch has a GEMM of ``w``'s dtype with float32 output on its device."""
    if w.device.type != "cuda" or w.dtype not in (torch.bfloat16, torch.float16):
        return False
    return "dtype" in torch.ops.aten.mm.overloads()


def _choose(w: torch.Tensor, bias: torch.Tensor | None) -> tuple[str, torch.Tensor | None]:
    """``("split", None)`` where the split GEMM runs and agrees with the chunked product
    on a slice of the head, else ``("chunked", buffer)``; logged either way."""
    if not _splittable(w):
        return "chunked", _buffer(w)
    part = w[:256]
    gen = torch.Generator(device=w.device).manual_seed(0)
    x = torch.randn(8, w.shape[1], device=w.device, generator=gen) * 4
    try:
        got = _split(x, part)
        want = _chunked(x, part, _buffer(part))
        err = float((got - want).abs().max())
        scale = float(want.abs().max())
    except Exception as exc:   # noqa: BLE001  (any failure of the fast path: use the exact slow one)
        log.warning("the split float32 head does not run here (%s: %s); the chunked one is used",
                    type(exc).__name__, exc)
        return "chunked", _buffer(w)
    if not err <= 1e-5 * max(scale, 1.0):
        log.warning("the split float32 head differs from the chunked one by %.3g (scale %.3g); the chunked one "
                    "is used", err, scale)
        return "chunked", _buffer(w)
    return "split", None


def _chunked(x: torch.Tensor, w: torch.Tensor, buffer: torch.Tensor, layout: str = "rows") -> torch.Tensor:
    """(n, H) float32 ``x`` times ``w``ᵀ, ``w`` cast into ``buffer`` a chunk of rows at a time
    (``layout``: :attr:`Head32.layout`)."""
    V, rows = w.shape[0], buffer.shape[0]
    out = torch.empty(x.shape[0], V, dtype=torch.float32, device=x.device)
    for i in range(0, V, rows):
        chunk = buffer[:min(rows, V - i)]
        chunk.copy_(w[i:i + rows])
        if layout == "columns":
            _columns(chunk, x, out=out[:, i:i + rows])
        else:
            torch.mm(x, chunk.T, out=out[:, i:i + rows])
    return out


def _split(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(n, H) float32 ``x`` times the bf16/fp16 ``w``ᵀ in float32: ``x`` as hi + mid + lo
    in ``w``'s dtype (hi is ``x`` rounded, mid the rest rounded, lo what is left rounded),
    one GEMM over the three with float32 output, summed smallest first."""
    outs = []
    for j in range(0, x.shape[0], SPLIT_ROWS):
        rows = x[j:j + SPLIT_ROWS]
        hi = rows.to(w.dtype)
        rest = rows - hi.float()
        mid = rest.to(w.dtype)
        lo = (rest - mid.float()).to(w.dtype)
        n = rows.shape[0]
        parts = torch.mm(torch.cat([hi, mid, lo]), w.T, out_dtype=torch.float32)
        outs.append((parts[2 * n:] + parts[n:2 * n]) + parts[:n])
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def project(head: Head32, hidden: torch.Tensor) -> torch.Tensor:
    """The head on float32 ``hidden`` (..., H) -> float32 (..., V), by ``head.method``."""
    if head.method == "float32" and head.layout == "rows":
        return F.linear(hidden, head.weight, head.bias)
    x = hidden.reshape(-1, hidden.shape[-1])
    if head.method == "float32":             # the "columns" layout
        out = _columns(head.weight, x)
    elif head.method == "split":
        out = _split(x, head.weight)
    else:
        out = _chunked(x, head.weight, head.buffer, head.layout)
    if head.bias is not None:
        out += head.bias
    return out.reshape(*hidden.shape[:-1], out.shape[-1])


def _columns(w: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(n, H) ``x`` times ``w``ᵀ as (W · xᵀ)ᵀ, :data:`COLUMN_BLOCK` rows of ``x`` at a time, each
    block padded to :data:`MIN_COLUMNS`: the transposed product is copied into ``out`` (an
    (n, V) view, made when None) block by block, so a long prompt's logits are not held
    twice (the chunked head passes its output's columns: no chunk-sized copy either)."""
    n = x.shape[0]
    if out is None:
        out = torch.empty(n, w.shape[0], dtype=torch.float32, device=x.device)
    for i in range(0, n, COLUMN_BLOCK):
        block = x[i:i + COLUMN_BLOCK]
        out[i:i + block.shape[0]] = torch.mm(w, at_least(block, MIN_COLUMNS).T)[:, :block.shape[0]].T
    return out


def _version(t: torch.Tensor) -> int | None:
    """The tensor's version counter (an in-place write bumps it); None for an inference
    tensor, which has none."""
    try:
        return t._version
    except RuntimeError:
        return None


def extra_bytes(model: torch.nn.Module) -> int:
    """Bytes the float32 head holds beyond the model's weights (its chunk buffer and the
    final norm's float32 copy; 0 for a float32 model)."""
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
    out = project(head, hidden.float())
    return _postprocess(model.config, out)


def advance(model: torch.nn.Module, **inputs: Any) -> None:
    """The decoder body alone over ``inputs`` (as :func:`logits` takes them): the cache
    advances, no logits are made. For tokens whose next-token law nobody reads (a
    question fed one token at a time): the head is most of a one-row forward's cost
    with a large vocabulary (Gemma 3: 262,144 × 640)."""
    parts = _parts(model)
    if parts is None:
        model(**inputs, logits_to_keep=1)
        return
    parts[0](**inputs)
