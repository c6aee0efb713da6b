"""Requests sized by memory: the budget, the gate, and the memory given back after a request.

The estimate's arithmetic (what a request holds at its peak, from the model's shapes)
is :mod:`gen_service.serving.memory`; this module holds what meets the running process.

:class:`MemoryGate` admits a request whose estimate fits the budget (default 80 % of
the device's free memory, or of available RAM on CPU, measured at start) and refuses
one that never can with :class:`RequestTooLarge`, whose message carries the numbers
and names the candidates that keep per-row copies of the prompt.
With continuous batching (``--max-batch-requests``, gen_service/serving/batching.py)
several trace requests decode at once: a request that fits joins the batch only while
the merged batch's estimate (:func:`~gen_service.serving.memory.batch_bytes`) fits the
budget, and waits otherwise; alone it always fits.
:func:`return_freed_memory` gives the C heap's free pages back to the OS after a large
request (:data:`TRIM_BYTES`).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Sequence
from typing import Any

from gen_service.errors import RequestTooLarge
from gen_service.presses.traits import wants_eager
from gen_service.serving.memory import (
    CandidateMemory,
    MemoryEstimate,
    ModelShape,
    SideMemory,
    TraceSize,
    batch_bytes,
    eager_attention_bytes,
    estimate,
    estimate_generate,
    prefill_bytes,
    prompt_logprobs_bytes,
)
from protocols import Kind

# the estimate's names stay importable from here, where the tests and benchmarks import them
__all__ = ["CandidateMemory", "MemoryEstimate", "MemoryGate", "ModelShape", "SideMemory", "TraceSize",
           "available_memory", "batch_bytes", "eager_attention_bytes", "estimate", "estimate_generate",
           "parse_budget", "prefill_bytes", "prompt_logprobs_bytes", "return_freed_memory", "TRIM_BYTES"]

DEFAULT_FRACTION = 0.8


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
