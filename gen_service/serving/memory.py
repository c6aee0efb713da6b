"""A trace request's memory from the model's shapes: the arithmetic of the estimate.

:func:`estimate` computes, from the model's shapes, R, the prompt length and T, an
upper bound of the memory one ``/v1/traces`` request adds on top of the loaded
weights (both sides, P and Q, whatever the candidate keeps):

- ``prompt_kv``: the prompt's keys/values, per candidate and per side as the engine
  will hold them (:class:`CandidateMemory`, :class:`SideMemory`, described from the
  built policies by :meth:`gen_service.serving.admission.MemoryGate.describe`): once on the shared prompt path
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

With continuous batching (gen_service/serving/batching.py) a merged batch pads every
prompt to the longest in it (the stacked forwards' pooled prompts) and sizes every row's
buffers for the largest T, so :func:`batch_bytes` counts each request (:class:`TraceSize`)
at the batch's longest prompt and largest T, not at its own.

Whether a request fits is decided in :mod:`gen_service.serving.admission` (the gate);
nothing here reads the device or the process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from protocols import WIRE_KINDS, Kind

__all__ = ["CandidateMemory", "MemoryEstimate", "ModelShape", "SideMemory", "TraceSize", "batch_bytes",
           "eager_attention_bytes", "estimate", "estimate_generate", "prefill_bytes", "prompt_logprobs_bytes"]

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

