"""Requests sized by memory: a trace request's peak KV and activation bytes, and a budget.

:func:`estimate` computes, from the model's shapes, R, the prompt length and T, an
upper bound of the memory one ``/v1/traces`` request adds on top of the loaded
weights (both sides, P and Q, whatever the candidate keeps):

- ``prompt_kv``: the prompt's keys/values, per candidate and per side as the engine
  will hold them (:class:`CandidateMemory`, :class:`SideMemory`, described from the
  built policies by :meth:`MemoryGate.describe`): once on the shared prompt path
  (gen_service/attention/shared_cache.py), R times for a side that keeps per-row copies (a
  press acting while decoding, a quantized cache, the copy path); the residual kind
  keeps one more batch-1 copy (the snapshot), and a per-row side whose branches are
  replayed up to R more for the branch rows;
- ``row_kv``: each row's own tokens, T slots per side (2T for residual traces, whose
  branches continue past the survival slots); a reference request holds what a
  coupled one does (Q is fed P's tokens instead of its own: the same caches, no
  snapshot, fewer (R, vocab) tensors per step than the coupling's);
- ``activations``: the larger of prefill (batch 1 over the prompt: hidden states, MLP,
  a tiled attention block, or under eager attention one layer's every score at once,
  :func:`eager_attention_bytes`) and one decoding step over R rows (hidden states and MLP
  for 2R rows, P's and Q's in one forward when fused, one layer's attention scores over
  the prompt, the (R, vocab) float32 tensors of the logits and the coupling, the
  transient copies of one layer's cache a per-row side makes, and the pooled copy of
  the shared sides' prompts, padded to the prompt's length, and of the rows' buffers
  that stacked forwards build once, docs/service.md "One attention call per layer");
  a multi-candidate request counts every candidate's rows;
- logit traces (``top_logprobs`` k > 0, gen_service/engine/top_logprobs.py): :data:`LOGIT_TENSORS`
  more (R, vocab) float32 tensors per step in ``activations``, and in ``row_kv`` the
  survival path's fields a residual request keeps for its branch points (T × R × (6k + 4)
  numbers of 4 bytes).

:func:`estimate_generate` does the same for a plain generation (TGI ``/generate``,
OpenAI completions), with TGI's prompt log-probabilities (:func:`prompt_logprobs_bytes`:
the (L, V) float32 logits and their log-softmax) when asked for.

:class:`MemoryGate` admits a request whose estimate fits the budget (default 80 % of
the device's free memory, or of available RAM on CPU, measured at start) and refuses
one that never can with :class:`RequestTooLarge`, whose message carries the numbers
and names the candidates that keep per-row copies of the prompt.
With continuous batching (``--max-batch-requests``, gen_service/serving/batching.py)
several trace requests decode at once: a request that fits joins the batch only while
the merged batch's estimate fits the budget, and waits otherwise; alone it always fits.
A merged batch pads every prompt to the longest in it (the stacked forwards' pooled
prompts) and sizes every row's buffers for the largest T, so :func:`batch_bytes`
counts each request (:class:`TraceSize`) at the batch's longest prompt and largest T,
not at its own.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from gen_service.errors import RequestTooLarge
from gen_service.presses.traits import wants_eager
from protocols import WIRE_KINDS, Kind

__all__ = ["CandidateMemory", "MemoryEstimate", "MemoryGate", "ModelShape", "SideMemory", "TraceSize",
           "available_memory", "batch_bytes", "eager_attention_bytes", "estimate", "estimate_generate",
           "parse_budget", "prefill_bytes", "prompt_logprobs_bytes", "return_freed_memory", "TRIM_BYTES"]

DEFAULT_FRACTION = 0.8
# (R, vocab) float32 tensors alive at once in a coupled step: P's and Q's logits and
# probabilities, min(p, q), the residuals and the cumulative sums of the draws.
COUPLING_TENSORS = 12
# (R, vocab) float32 tensors alive at once while a step's logit traces are computed:
# log p, log q and the terms of one KL or entropy sum with its mask.
LOGIT_TENSORS = 4
PREFILL_TILE = 1024   # key columns a tiled attention kernel holds per query block


@dataclass(frozen=True)
class ModelShape:
    """The shapes that size a request's memory.

    Examples
    --------
    >>> from transformers import LlamaConfig
    >>> s = ModelShape.of(LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
    ...                               num_key_value_heads=2, intermediate_size=128, vocab_size=320))
    >>> s.kv_bytes_per_token
    512
    """

    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 4

    @classmethod
    def of(cls, config: Any, dtype_bytes: int = 4) -> ModelShape:
        """From a transformers config (``num_key_value_heads`` defaults to the query heads)."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(layers=config.num_hidden_layers, q_heads=heads,
                   kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
                   hidden=config.hidden_size, intermediate=config.intermediate_size, vocab=config.vocab_size,
                   dtype_bytes=dtype_bytes)

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys + values of one token over all layers, one side."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one request adds to the loaded model (an upper bound), by part."""

    prompt_kv: int
    row_kv: int
    activations: int
    rows: int

    @property
    def total(self) -> int:
        return self.prompt_kv + self.row_kv + self.activations

    @property
    def per_row(self) -> int:
        """Bytes each additional row adds (its own KV slots and its activations share)."""
        return -(-self.row_kv // max(self.rows, 1))

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total, "per_row": self.per_row}

    def describe(self) -> str:
        mib = 1 << 20
        return (f"{self.total / mib:.0f} MiB (prompt KV {self.prompt_kv / mib:.0f}, rows' KV "
                f"{self.row_kv / mib:.0f} = {self.per_row / 1024:.0f} KiB/row, activations "
                f"{self.activations / mib:.0f})")


@dataclass(frozen=True)
class SideMemory:
    """How one side (P or Q) of one candidate holds the prompt while decoding.

    Parameters
    ----------
    shared : bool
        The prompt stored once for all rows (gen_service/attention/shared_cache.py), or once per
        row (a press acting while decoding, a quantized cache, the copy path).
    prompt_tokens : int or None
        Prompt slots the side keeps (an upper bound); None for the request's whole
        prompt, the safe bound.
    quantized : bool
        A quantized cache (gen_service/presses/quantized.py), whose flushes re-quantize a whole
        layer at once (:data:`FLUSH_TRANSIENT`).
    decoding : bool
        A press acting while decoding (DecodingPress, DMS with ``decoding=true`` ...).
    eager : bool
        Prefilled under eager attention (a press scoring with the attention weights:
        ObservedAttention/H2O, KVCompose), whose L × L scores are held at once
        (:func:`eager_attention_bytes`).

    Examples
    --------
    >>> SideMemory(shared=False).kept(783), SideMemory(prompt_tokens=400).kept(783)
    (783, 400)
    >>> s = ModelShape(layers=2, q_heads=4, kv_heads=2, head_dim=16, hidden=64, intermediate=128, vocab=320)
    >>> SideMemory().transient(s), SideMemory(False, decoding=True).transient(s)
    (0, 3)
    """

    shared: bool = True
    prompt_tokens: int | None = None
    quantized: bool = False
    decoding: bool = False
    eager: bool = False

    def kept(self, prompt_tokens: int) -> int:
        """The slots it keeps of a ``prompt_tokens``-token prompt."""
        return prompt_tokens if self.prompt_tokens is None else min(self.prompt_tokens, prompt_tokens)

    def transient(self, shape: ModelShape) -> int:
        """Copies of one layer's per-row cache (keys and values) alive at once while this
        side decodes; 0 on the shared path, whose rows' buffers are preallocated and
        written in place."""
        if self.shared:
            return 0
        gqa = -(-shape.q_heads // shape.kv_heads)
        return APPEND_TRANSIENT + (FLUSH_TRANSIENT if self.quantized else 0) + (gqa if self.decoding else 0)


# Transient copies of one layer's per-row cache while a per-row side decodes, checked
# against the allocations measured on tiny:llama (tests/test_memory.py, docs/measurements.md):
# appending concatenates the layer's cache with the new token into a new tensor
# (DynamicCache, the keys a QuantizedLayer returns): one copy. A quantized cache's flush
# re-quantizes the whole layer: its padded, shifted, scaled and rounded intermediates
# and the new quantized part make up to three more. A press acting while decoding
# scores the layer and hides keys per head, and attention under a per-head mask takes
# the path that repeats the keys and values for every query head: q_heads / kv_heads more.
APPEND_TRANSIENT = 1
FLUSH_TRANSIENT = 3


def eager_attention_bytes(shape: ModelShape, tokens: int) -> int:
    """One layer's eager attention over ``tokens`` queries and keys at once, at its peak
    (transformers' ``eager_attention_forward``, which kvpress's attention-scoring presses
    need): the masked scores in the model's dtype, their float32 copy and softmax
    (``softmax(dtype=float32)`` casts a bf16 input first, on CUDA as on CPU), every query
    head, plus the (L, L) causal mask and its boolean form, shared by the layers. Only
    one layer's scores are alive at a time.

    Examples
    --------
    >>> s = ModelShape(layers=32, q_heads=32, kv_heads=8, head_dim=128, hidden=4096, intermediate=14336,
    ...                vocab=128256, dtype_bytes=2)
    >>> round(eager_attention_bytes(s, 4096) / 1e9, 1), round(eager_attention_bytes(s, 16384) / 1e9)
    (5.4, 87)
    """
    b = shape.dtype_bytes
    per_score = b + 4 + (4 if b < 4 else 0)
    return shape.q_heads * tokens * tokens * per_score + tokens * tokens * (b + 1)


def prefill_bytes(shape: ModelShape, tokens: int, eager: bool = False) -> int:
    """Activations of one batch-1 prefill over ``tokens`` tokens: hidden states and MLP,
    the float32 final hidden state (gen_service/models/float_head.py), and one layer's attention:
    a tiled block (SDPA's fused kernels) or, under eager attention, every score at once."""
    mlp = shape.hidden * 6 + shape.intermediate * 3
    attention = (eager_attention_bytes(shape, tokens) if eager
                 else shape.q_heads * tokens * min(tokens, PREFILL_TILE) * 4)
    return tokens * (mlp * shape.dtype_bytes + shape.hidden * 4) + attention


def prompt_logprobs_bytes(shape: ModelShape, tokens: int) -> int:
    """TGI's ``decoder_input_details`` (:func:`gen_service.engine.generate.prompt_logprobs`): a
    full-model forward over the prompt, no cache kept, then the (L, V) float32 logits
    and their log-softmax, both alive at once, besides the float32 final hidden state.

    Examples
    --------
    >>> s = ModelShape(layers=32, q_heads=32, kv_heads=8, head_dim=128, hidden=4096, intermediate=14336,
    ...                vocab=128256, dtype_bytes=2)
    >>> round(prompt_logprobs_bytes(s, 4096) / 1e9, 1)
    4.3
    """
    head = 2 * tokens * shape.vocab * 4 + tokens * shape.hidden * (4 + shape.dtype_bytes)
    return max(prefill_bytes(shape, tokens), head)


@dataclass(frozen=True)
class CandidateMemory:
    """One candidate's two sides and whether its residual branches are replayed.

    Parameters
    ----------
    policy : str
        The candidate's policy id (named by :class:`RequestTooLarge`).
    p, q : SideMemory
        The reference's side and the candidate's.
    replayed : bool
        Residual branches replayed from the post-prefill snapshot (a press acting while
        decoding, a quantized cache): a per-row side then rebuilds up to R more per-row
        copies of its prompt for the branch rows while the survival rows are alive.

    Examples
    --------
    >>> c = CandidateMemory("quant:kivi@2", q=SideMemory(shared=False, quantized=True), replayed=True)
    >>> c.per_row_sides, c.prompt_copies(c.q, 16, "residual"), c.prompt_copies(c.p, 16, "residual")
    ('Q', 33, 2)
    """

    policy: str = "full"
    p: SideMemory = SideMemory()
    q: SideMemory = SideMemory()
    replayed: bool = False

    @property
    def per_row_sides(self) -> str:
        """The sides that store per-row copies: ``""``, ``"P"``, ``"Q"`` or ``"P and Q"``."""
        return " and ".join(name for name, side in (("P", self.p), ("Q", self.q)) if not side.shared)

    def prompt_copies(self, side: SideMemory, rows: int, kind: str) -> int:
        """Prompt copies one side holds at its peak: once (shared) or R times (per row),
        one batch-1 snapshot for residual requests, and R more for the replayed branch
        rows of a per-row side."""
        residual = kind == Kind.RESIDUAL
        if side.shared:
            return 1 + residual
        return rows + residual + (rows if residual and self.replayed else 0)


def estimate(shape: ModelShape, rows: int, prompt_tokens: int, horizon: int, kind: str = "coupled",
             shared_prompt: bool = True, candidates: int = 1,
             sides: Sequence[CandidateMemory] | None = None, top_logprobs: int = 0,
             batch_prompt_tokens: int | None = None, key_block: int = 1) -> MemoryEstimate:
    """Peak memory of one trace request beyond the weights.

    Parameters
    ----------
    shape : ModelShape
        The model's shapes and KV dtype size.
    rows, prompt_tokens, horizon : int
        R, the prompt's length (context + question) and T.
    kind : str
        ``"coupled"``, ``"residual"`` or ``"reference"`` (sized as coupled).
    shared_prompt : bool
        Whether the engine stores the prompt once (default) or once per row; used for
        every side when ``sides`` is not given.
    candidates : int
        Candidates in the request (``candidates``): each holds its own P and Q prompt
        caches (and snapshots) and its own R rows, and the stacked forwards run over
        every candidate's rows at once, so the rows' KV and the decoding activations
        count ``candidates × rows`` rows. Ignored when ``sides`` is given.
    sides : sequence of CandidateMemory, optional
        Each candidate's sides as the engine will hold them (:meth:`MemoryGate.describe`):
        a per-row side counts R copies of the prompt slots it keeps (2R + 1 for
        replayed residual branches) and the transient copies of one layer's per-row
        cache its appends (and a quantized cache's flushes) make. None: ``candidates``
        candidates whose sides all follow ``shared_prompt``.
    top_logprobs : int
        k of the logit traces (0: none), see the module docstring.
    batch_prompt_tokens : int, optional
        The longest prompt of the decoding batch the request shares (:func:`batch_bytes`):
        its pooled prompt is padded to it and its rows attend over that many slots. Its
        own caches and prefill keep ``prompt_tokens``.
    key_block : int
        The pooled prompt's slots are a multiple of this (the CPU kernel's key block,
        :func:`gen_service.attention.shared_cache.pooled_length`; 1 on CUDA): a request
        alone pools its prompt rounded up to it too.

    Returns
    -------
    MemoryEstimate

    Raises
    ------
    ValueError
        An unknown ``kind``, or a count below 1.

    Examples
    --------
    >>> s = ModelShape(layers=30, q_heads=9, kv_heads=3, head_dim=64, hidden=576, intermediate=1536,
    ...                vocab=49152)
    >>> shared = estimate(s, 64, 783, 32)
    >>> copies = estimate(s, 64, 783, 32, shared_prompt=False)
    >>> copies.prompt_kv // shared.prompt_kv, shared.per_row // 1024
    (64, 2880)
    >>> four = estimate(s, 64, 783, 32, candidates=4)
    >>> four.prompt_kv // shared.prompt_kv, four.row_kv // shared.row_kv
    (4, 4)
    >>> q_rows = CandidateMemory("dms", q=SideMemory(shared=False))
    >>> (estimate(s, 64, 783, 32, sides=[q_rows]).prompt_kv - shared.prompt_kv) // (783 * s.kv_bytes_per_token)
    63
    """
    if kind not in WIRE_KINDS:
        raise ValueError(f"kind: {kind!r} is not one of {WIRE_KINDS}")
    if sides is None:
        side = SideMemory(shared_prompt)
        sides = [CandidateMemory(p=side, q=side)] * max(candidates, 0)
    if min(rows, prompt_tokens, horizon, len(sides)) < 1:
        raise ValueError(f"rows, prompt_tokens, horizon and candidates must be >= 1, got {rows}, {prompt_tokens}, "
                         f"{horizon}, {len(sides)}")
    token = shape.kv_bytes_per_token
    slots = horizon * (2 if kind == Kind.RESIDUAL else 1)
    padded = max(prompt_tokens, batch_prompt_tokens or 0)
    padded = -(-padded // key_block) * key_block   # the pool rounds up (batch invariance on the CPU)
    prompt_kv = transient = pooled = 0
    for cand in sides:
        for side in (cand.p, cand.q):
            kept = side.kept(prompt_tokens)
            prompt_kv += cand.prompt_copies(side, rows, kind) * kept * token
            # a shared side's prompt moves into the pool, whose slot is the batch's longest
            # prompt (rounded up on the CPU) for every group, the compressed side's too
            prompt_kv += max(padded - kept, 0) * token if side.shared else 0
            transient += side.transient(shape) * rows * (kept + slots) * token // shape.layers
            # stacked forwards pool the shared sides' prompts, padded to the longest
            # (gen_service.attention.shared_cache._Pool), next to the old tensors while it is built
            pooled += padded * token if side.shared else 0
    rows *= len(sides)   # every candidate's rows, decoded together
    row_kv = 2 * rows * slots * token
    transient += pooled + (row_kv if pooled else 0)   # and the rows' buffers, copied once into it
    if top_logprobs and kind == Kind.RESIDUAL:   # each survival step's fields, kept for the branch points
        row_kv += horizon * rows * (6 * top_logprobs + 4) * 4
    b = shape.dtype_bytes
    mlp = shape.hidden * 6 + shape.intermediate * 3
    # prefills run one at a time (the question after it is short): the largest counts
    eager = any(side.eager for cand in sides for side in (cand.p, cand.q))
    prefill = prefill_bytes(shape, prompt_tokens, eager)
    keys = padded + slots
    decode = (2 * rows * mlp * b                       # P's and Q's rows in one forward when fused
              + 2 * shape.q_heads * rows * keys * 4         # one layer's scores and weights, float32
              + (COUPLING_TENSORS + (LOGIT_TENSORS if top_logprobs else 0)) * rows * shape.vocab * 4
              + transient)
    return MemoryEstimate(prompt_kv=prompt_kv, row_kv=row_kv, activations=max(prefill, decode), rows=rows)


def estimate_generate(shape: ModelShape, prompt_tokens: int, new_tokens: int, eager: bool = False,
                      prompt_logprobs: bool = False) -> MemoryEstimate:
    """Peak memory of one plain generation (TGI ``/generate``, OpenAI completions) beyond
    the weights: one batch-1 cache of the whole prompt and the new tokens, and the larger
    of its prefill (:func:`prefill_bytes`; eager attention for presses scoring with the
    attention weights), a decoding step and, with ``prompt_logprobs``, the full-model
    forward of :func:`prompt_logprobs_bytes` (run after the generation's cache is freed).

    Examples
    --------
    >>> s = ModelShape(layers=32, q_heads=32, kv_heads=8, head_dim=128, hidden=4096, intermediate=14336,
    ...                vocab=128256, dtype_bytes=2)
    >>> plain, details = estimate_generate(s, 4096, 16), estimate_generate(s, 4096, 16, prompt_logprobs=True)
    >>> round(plain.total / 1e9, 1), round(details.total / 1e9, 1)
    (1.7, 4.8)
    """
    if min(prompt_tokens, new_tokens) < 1:
        raise ValueError(f"prompt_tokens and new_tokens must be >= 1, got {prompt_tokens}, {new_tokens}")
    token = shape.kv_bytes_per_token
    mlp = shape.hidden * 6 + shape.intermediate * 3
    decode = mlp * shape.dtype_bytes + 2 * shape.q_heads * (prompt_tokens + new_tokens) * 4 \
        + COUPLING_TENSORS * shape.vocab * 4
    activations = max(prefill_bytes(shape, prompt_tokens, eager), decode,
                      prompt_logprobs_bytes(shape, prompt_tokens) if prompt_logprobs else 0)
    return MemoryEstimate(prompt_kv=prompt_tokens * token, row_kv=new_tokens * token, activations=activations,
                          rows=1)


def return_freed_memory() -> bool:
    """Give the free pages of the C heap back to the OS once a request's tensors are gone.

    A CPU tensor is C ``malloc`` memory. glibc returns a freed block to the OS only when it
    was mapped on its own, above the mmap threshold, and that threshold rises to the size
    of every such block freed (up to 32 MiB), so a large request's caches and activations,
    freed, stay in the heap's arenas; and tensors held only by reference cycles wait for the
    garbage collector, which a quiet server never runs. A full collection, then
    ``malloc_trim(0)`` (every arena's free pages) brought a cancelled R = 128 request's CPU
    server back below its RSS before it (-2.8 % at the second such request; +37.4 % without
    either, +19.7 % with the trim alone; docs/service.md, "The intake"). Elsewhere than glibc,
    only the collection is done.

    Returns
    -------
    bool
        Whether glibc's ``malloc_trim`` was called and released memory.
    """
    global _LIBC
    gc.collect()   # tensors held only by reference cycles wait for the collector, which a quiet server never runs
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    return bool(_LIBC and _LIBC.malloc_trim(0))


_LIBC: Any = None   # glibc, loaded at the first trim (False: not glibc)
#: Requests whose memory estimate reaches this are followed by :func:`return_freed_memory`:
#: a full collection takes ~0.7 s in a server process (2 loaded cores), worth it only after
#: a request that held this much.
TRIM_BYTES = 256 << 20


def available_memory(device: Any = "cpu") -> int:
    """Free bytes on ``device``: CUDA's free memory, or the RAM the OS reports available."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free)
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


class MemoryGate:
    """Admits requests whose estimate fits ``budget`` bytes.

    Parameters
    ----------
    shape : ModelShape
        The served model's shapes.
    budget : int
        Bytes a request may use beyond the weights.
    shared_prompt : bool
        Whether the engine stores the prompt once per request.

    Examples
    --------
    >>> s = ModelShape(layers=2, q_heads=4, kv_heads=2, head_dim=16, hidden=64, intermediate=128, vocab=320)
    >>> gate = MemoryGate(s, budget=100 << 20)
    >>> gate.admit(rows=16, prompt_tokens=100, horizon=32).total < gate.budget
    True
    >>> gate.max_rows(prompt_tokens=100, horizon=32) >= 1024
    True
    """

    def __init__(self, shape: ModelShape, budget: int, shared_prompt: bool = True, head_bytes: int = 0,
                 key_block: int = 1):
        self.shape, self.budget, self.shared_prompt = shape, int(budget), shared_prompt
        self.head_bytes = int(head_bytes)   # the float32 head copy, held since loading (outside the budget)
        self.key_block = int(key_block)     # a merged batch's pooled prompt is a multiple of this (batch_bytes)

    @classmethod
    def for_engine(cls, engine: Any, budget: float | None = None) -> MemoryGate:
        """For an engine's model; ``budget`` in bytes, a fraction (<= 1) of the memory
        free now, or None for :data:`DEFAULT_FRACTION` of it."""
        from gen_service.attention.shared_cache import pooled_length  # lazily: this module does not import torch
        from gen_service.models.float_head import extra_bytes

        lm = engine.lm
        shape = ModelShape.of(lm.model.config, dtype_bytes=lm.dtype.itemsize)
        head = extra_bytes(lm.model)   # made at load (gen_service/models/loading.py): already out of the free memory
        if budget is None or budget <= 1:
            budget = (budget or DEFAULT_FRACTION) * available_memory(lm.device)
        return cls(shape, int(budget), getattr(engine, "shared_prompt", True), head, pooled_length(1, lm.device))

    def describe(self, policy: str, reference: Any, candidate: Any, kind: str = "coupled") -> CandidateMemory:
        """How the engine will hold one candidate's sides, from the two policies' plans.

        Parameters
        ----------
        policy : str
            The candidate's policy id.
        reference, candidate : gen_service.presses.registry.PressPlan
            :meth:`Policy.plan` of the reference and of the candidate for this prompt
            (``decoding``: a press acting while decoding; ``quant``: a quantized cache).
        kind : str
            ``"coupled"`` or ``"residual"``.

        Returns
        -------
        CandidateMemory
            A side keeps per-row copies where the engine's :func:`gen_service.attention.shared_cache.can_share`
            will refuse the shared prompt: a press acting while decoding, a quantized
            cache, or an engine without the shared path. Those sides replay their
            residual branches. The prompt slots kept are bounded by the whole prompt
            (head-wise and decoding-time presses keep every slot until they evict).
        """
        def side(plan: Any) -> SideMemory:
            quantized = plan.quant is not None
            return SideMemory(self.shared_prompt and not plan.decoding and not quantized, quantized=quantized,
                              decoding=plan.decoding, eager=wants_eager(plan.press))

        p, q = side(reference), side(candidate)
        # the engine replays when a press acts while decoding or a cache is quantized (and for
        # per-layer budgets, known only after prefill: on the shared path that costs no prompt
        # copy; on the copy path count it)
        replay = not self.shared_prompt or not (p.shared and q.shared)
        return CandidateMemory(policy, p, q, replayed=replay and kind == Kind.RESIDUAL)

    def estimate(self, rows: int, prompt_tokens: int, horizon: int, kind: str = "coupled",
                 candidates: int = 1, sides: Sequence[CandidateMemory] | None = None,
                 top_logprobs: int = 0) -> MemoryEstimate:
        """:func:`estimate` with the gate's shapes (``sides`` overrides ``candidates``)."""
        return estimate(self.shape, rows, prompt_tokens, horizon, kind, self.shared_prompt, candidates, sides,
                        top_logprobs, key_block=self.key_block)

    def size(self, rows: int, prompt_tokens: int, horizon: int, kind: str = "coupled", candidates: int = 1,
             sides: Sequence[CandidateMemory] | None = None, top_logprobs: int = 0) -> TraceSize:
        """A request's :class:`TraceSize` with the gate's shapes (what the batch counts)."""
        return TraceSize(self.shape, rows, prompt_tokens, horizon, kind, self.shared_prompt, candidates,
                         None if sides is None else tuple(sides), top_logprobs, self.key_block)

    def admit(self, rows: int, prompt_tokens: int, horizon: int, kind: str = "coupled",
              candidates: int = 1, sides: Sequence[CandidateMemory] | None = None,
              top_logprobs: int = 0) -> MemoryEstimate:
        """The request's estimate if it fits the budget (``candidates``, ``sides``, ``top_logprobs``:
        see :func:`estimate`).

        Returns
        -------
        MemoryEstimate

        Raises
        ------
        RequestTooLarge
            When it never can, with the estimate, the budget, the largest R that fits
            and the candidates whose sides keep per-row copies of the prompt.
        """
        est = self.estimate(rows, prompt_tokens, horizon, kind, candidates, sides, top_logprobs)
        if est.total > self.budget:
            count = len(sides) if sides is not None else candidates
            fit = self.max_rows(prompt_tokens, horizon, kind, candidates=candidates, sides=sides,
                                top_logprobs=top_logprobs)
            many = f" for each of {count} candidates" if count > 1 else ""
            raise RequestTooLarge(
                f"needs an estimated {est.describe()} for R={rows}{many}, a {prompt_tokens}-token prompt and "
                f"T={horizon} ({kind}); the memory budget is {self.budget / (1 << 20):.0f} MiB: "
                + (f"at most R={fit} fits" if fit else "no R fits; shorten the prompt or T")
                + self._per_row_note(rows, prompt_tokens, kind, sides)
                + self._eager_note(prompt_tokens, sides))
        return est

    def _eager_note(self, prompt_tokens: int, sides: Sequence[CandidateMemory] | None) -> str:
        """Which candidates prefill under eager attention, and what one layer's scores cost."""
        names = [c.policy for c in sides or () if c.p.eager or c.q.eager]
        if not names:
            return ""
        cost = eager_attention_bytes(self.shape, prompt_tokens) / (1 << 20)
        return (f"; {', '.join(names)} prefill{'s' if len(names) == 1 else ''} under eager attention: one "
                f"layer's {prompt_tokens} x {prompt_tokens} attention scores take {cost:.0f} MiB")

    def admit_generate(self, prompt_tokens: int, new_tokens: int, eager: bool = False,
                       prompt_logprobs: bool = False) -> MemoryEstimate:
        """A plain generation's estimate (:func:`estimate_generate`) if it fits the budget.

        Raises
        ------
        RequestTooLarge
            Naming what does not fit: the eager-attention prefill, the prompt
            log-probabilities (``decoder_input_details``), or the generation itself.
        """
        est = estimate_generate(self.shape, prompt_tokens, new_tokens, eager, prompt_logprobs)
        if est.total <= self.budget:
            return est
        mib = 1 << 20
        parts = [f"needs an estimated {est.describe()} for a {prompt_tokens}-token prompt and {new_tokens} new "
                 f"tokens; the memory budget is {self.budget / mib:.0f} MiB"]
        if prompt_logprobs:
            parts.append(f"the prompt log-probabilities (decoder_input_details) alone take "
                         f"{prompt_logprobs_bytes(self.shape, prompt_tokens) / mib:.0f} MiB ({prompt_tokens} x "
                         f"{self.shape.vocab} float32 logits and their log-softmax)")
        if eager:
            parts.append(f"the policy prefills under eager attention: one layer's {prompt_tokens} x "
                         f"{prompt_tokens} attention scores take "
                         f"{eager_attention_bytes(self.shape, prompt_tokens) / mib:.0f} MiB")
        raise RequestTooLarge("; ".join(parts) + "; shorten the prompt")

    def _per_row_note(self, rows: int, prompt_tokens: int, kind: str,
                      sides: Sequence[CandidateMemory] | None) -> str:
        """Which candidates store the prompt once per row, and what that costs."""
        notes = []
        for i, cand in enumerate(sides or ()):
            if cand.per_row_sides:
                copies = sum(cand.prompt_copies(s, rows, kind) * s.kept(prompt_tokens)
                             for s in (cand.p, cand.q) if not s.shared) * self.shape.kv_bytes_per_token
                name = f"candidates[{i}]" if len(sides) > 1 else "candidate"
                notes.append(f"{name} ({cand.policy}) keeps per-row copies of the prompt on its "
                             f"{cand.per_row_sides} side{'s' if ' and ' in cand.per_row_sides else ''} "
                             f"({copies / (1 << 20):.0f} MiB at R={rows})")
        return "; " + "; ".join(notes) if notes else ""

    def max_rows(self, prompt_tokens: int, horizon: int, kind: str = "coupled", limit: int = 1 << 20,
                 candidates: int = 1, sides: Sequence[CandidateMemory] | None = None, top_logprobs: int = 0) -> int:
        """The largest R (per candidate) whose estimate fits the budget (0 if none), by bisection."""
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.estimate(mid, prompt_tokens, horizon, kind, candidates, sides, top_logprobs).total <= self.budget:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def info(self) -> dict[str, Any]:
        """What /info reports: the budget and the shapes it sizes requests with."""
        return {"memory_budget": self.budget, "kv_bytes_per_token": self.shape.kv_bytes_per_token,
                "shared_prompt": self.shared_prompt, "fp32_head_bytes": self.head_bytes}


@dataclass(frozen=True)
class TraceSize:
    """One trace request's memory as the decoding batch counts it: its own estimate, and
    its estimate inside a merged batch (:func:`batch_bytes`).

    Examples
    --------
    >>> s = ModelShape(layers=2, q_heads=4, kv_heads=2, head_dim=16, hidden=64, intermediate=128, vocab=320)
    >>> a, b = TraceSize(s, rows=8, prompt_tokens=50, horizon=64), TraceSize(s, rows=8, prompt_tokens=400, horizon=8)
    >>> a.within(400, 64) > a.total and a.within(10, 8) == a.total
    True
    """

    shape: ModelShape
    rows: int
    prompt_tokens: int
    horizon: int
    kind: str = "coupled"
    shared_prompt: bool = True
    candidates: int = 1
    sides: tuple[CandidateMemory, ...] | None = None
    top_logprobs: int = 0
    #: the pooled prompt's length is rounded up to a multiple of this in a merged batch
    #: (gen_service.attention.shared_cache.pooled_length: the CPU kernel's key block)
    key_block: int = 1

    @property
    def total(self) -> int:
        """Its estimate alone (what the 422 check compares with the budget)."""
        return self.within(self.prompt_tokens, self.horizon)

    def within(self, prompt_tokens: int, horizon: int) -> int:
        """Its estimate in a batch whose longest prompt and largest T are these (never
        below its own): its pooled prompt padded to the longest, its rows' buffers sized
        for the largest T, its attention over both; its own caches and prefill as alone."""
        return estimate(self.shape, self.rows, self.prompt_tokens, max(horizon, self.horizon), self.kind,
                        self.shared_prompt, self.candidates, self.sides, self.top_logprobs,
                        batch_prompt_tokens=prompt_tokens, key_block=self.key_block).total


def batch_bytes(sizes: Sequence[TraceSize]) -> int:
    """What a merged decoding batch of these requests holds at its peak (an upper bound):
    every request at the batch's longest prompt and largest T. The stacked forwards pool
    every group's prompt padded to the longest, rounded up to the key block on the CPU
    (gen_service.attention.shared_cache._Pool) and size
    every row's buffer for the largest capacity, and one layer's attention over them.

    Examples
    --------
    >>> s = ModelShape(layers=2, q_heads=4, kv_heads=2, head_dim=16, hidden=64, intermediate=128, vocab=320)
    >>> small = [TraceSize(s, rows=8, prompt_tokens=50, horizon=64)] * 7
    >>> big = TraceSize(s, rows=8, prompt_tokens=50, horizon=256)
    >>> batch_bytes(small + [big]) > sum(x.total for x in small + [big])
    True
    """
    if not sizes:
        return 0
    block = max(x.key_block for x in sizes)
    longest = -(-max(x.prompt_tokens for x in sizes) // block) * block
    widest = max(x.horizon for x in sizes)
    return sum(x.within(longest, widest) for x in sizes)


def parse_budget(text: str | float | None) -> float | None:
    """``--memory-budget``: bytes (``8e9``, ``512MiB``, ``8GiB``, ``8GB``) or a fraction
    of the free memory (``0.5``); None or empty for the default.

    Examples
    --------
    >>> parse_budget("8GiB"), parse_budget("0.5"), parse_budget("512MB"), parse_budget(None)
    (8589934592.0, 0.5, 512000000.0, None)
    """
    if text is None or text == "":
        return None
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        s = text.strip().upper().replace(" ", "")
        units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40,
                 "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "B": 1}
        scale = 1.0
        for unit, mult in units.items():
            if s.endswith(unit):
                s, scale = s[: -len(unit)], float(mult)
                break
        try:
            value = float(s) * scale
        except ValueError:
            raise ValueError(f"memory budget: {text!r} is neither bytes (e.g. 8GiB) "
                             "nor a fraction (e.g. 0.5)") from None
    if value <= 0:
        raise ValueError(f"memory budget: {text!r} must be positive")
    return value
