"""Requests sized by memory: a trace request's peak KV and activation bytes, and a budget.

:func:`estimate` computes, from the model's shapes, R, the prompt length and T, an
upper bound of the memory one ``/v1/traces`` request adds on top of the loaded
weights (both sides, P and Q, whatever the candidate keeps):

- ``prompt_kv``: the prompt's keys/values, once per side on the shared prompt path
  (gen_service/shared_cache.py), R times per side on the per-row copy path; the
  residual kind keeps one more batch-1 copy (snapshots for replayed branches);
- ``row_kv``: each row's own tokens, T slots per side (2T for residual traces, whose
  branches continue past the survival slots);
- ``activations``: the larger of prefill (batch 1 over the prompt: hidden states, MLP,
  a tiled attention block) and one decoding step over R rows (hidden states and MLP
  for 2R rows, P's and Q's in one forward when fused, one layer's attention scores over
  the prompt, the (R, vocab) float32 tensors of the logits and the coupling); a
  multi-candidate request counts every candidate's rows;

:class:`MemoryGate` admits a request whose estimate fits the budget (default 80 % of
the device's free memory, or of available RAM on CPU, measured at start) and refuses
one that never can with :class:`RequestTooLarge`, whose message carries the numbers.
The engine runs one request at a time, so a request that fits waits in the ordinary
queue until the one before it is done: it always fits then.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from gen_service.errors import ServiceError

__all__ = ["MemoryEstimate", "MemoryGate", "ModelShape", "RequestTooLarge", "available_memory", "estimate",
           "parse_budget"]

DEFAULT_FRACTION = 0.8
# (R, vocab) float32 tensors alive at once in a coupled step: P's and Q's logits and
# probabilities, min(p, q), the residuals and the cumulative sums of the draws.
COUPLING_TENSORS = 12
PREFILL_TILE = 1024   # key columns a tiled attention kernel holds per query block


class RequestTooLarge(ServiceError, ValueError):
    """A request whose estimated memory exceeds the whole budget: it can never run."""


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


def estimate(shape: ModelShape, rows: int, prompt_tokens: int, horizon: int, kind: str = "coupled",
             shared_prompt: bool = True, candidates: int = 1) -> MemoryEstimate:
    """Peak memory of one trace request beyond the weights.

    Parameters
    ----------
    shape : ModelShape
        The model's shapes and KV dtype size.
    rows, prompt_tokens, horizon : int
        R, the prompt's length (context + question) and T.
    kind : str
        ``"coupled"`` or ``"residual"``.
    shared_prompt : bool
        Whether the engine stores the prompt once (default) or once per row.
    candidates : int
        Candidates in the request (``candidates``): each holds its own P and Q prompt
        caches (and snapshots) and its own R rows, and the stacked forwards run over
        every candidate's rows at once, so the rows' KV and the decoding activations
        count ``candidates × rows`` rows.

    Returns
    -------
    MemoryEstimate

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
    """
    if kind not in ("coupled", "residual"):
        raise ValueError(f"kind: {kind!r} is neither 'coupled' nor 'residual'")
    if min(rows, prompt_tokens, horizon, candidates) < 1:
        raise ValueError(f"rows, prompt_tokens, horizon and candidates must be >= 1, got {rows}, {prompt_tokens}, "
                         f"{horizon}, {candidates}")
    token = shape.kv_bytes_per_token
    copies = 1 if shared_prompt else rows
    snapshots = 1 if kind == "residual" else 0
    prompt_kv = 2 * (copies + snapshots) * prompt_tokens * token * candidates
    rows *= candidates   # every candidate's rows, decoded together
    slots = horizon * (2 if kind == "residual" else 1)
    row_kv = 2 * rows * slots * token
    b = shape.dtype_bytes
    mlp = shape.hidden * 6 + shape.intermediate * 3
    prefill = (prompt_tokens * mlp * b
               + shape.q_heads * prompt_tokens * min(prompt_tokens, PREFILL_TILE) * 4)
    keys = prompt_tokens + slots
    decode = (2 * rows * mlp * b                       # P's and Q's rows in one forward when fused
              + 2 * shape.q_heads * rows * keys * 4         # one layer's scores and weights, float32
              + COUPLING_TENSORS * rows * shape.vocab * 4)
    return MemoryEstimate(prompt_kv=prompt_kv, row_kv=row_kv, activations=max(prefill, decode), rows=rows)


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

    def __init__(self, shape: ModelShape, budget: int, shared_prompt: bool = True):
        self.shape, self.budget, self.shared_prompt = shape, int(budget), shared_prompt

    @classmethod
    def for_engine(cls, engine: Any, budget: float | None = None) -> MemoryGate:
        """For an engine's model; ``budget`` in bytes, a fraction (<= 1) of the memory
        free now, or None for :data:`DEFAULT_FRACTION` of it."""
        lm = engine.lm
        shape = ModelShape.of(lm.model.config, dtype_bytes=lm.dtype.itemsize)
        if budget is None or budget <= 1:
            budget = (budget or DEFAULT_FRACTION) * available_memory(lm.device)
        return cls(shape, int(budget), getattr(engine, "shared_prompt", True))

    def estimate(self, rows: int, prompt_tokens: int, horizon: int, kind: str = "coupled",
                 candidates: int = 1) -> MemoryEstimate:
        return estimate(self.shape, rows, prompt_tokens, horizon, kind, self.shared_prompt, candidates)

    def admit(self, rows: int, prompt_tokens: int, horizon: int, kind: str = "coupled",
              candidates: int = 1) -> MemoryEstimate:
        """The request's estimate if it fits the budget (``candidates``: see :func:`estimate`).

        Raises
        ------
        RequestTooLarge
            When it never can, with the estimate, the budget and the largest R that fits.
        """
        est = self.estimate(rows, prompt_tokens, horizon, kind, candidates)
        if est.total > self.budget:
            fit = self.max_rows(prompt_tokens, horizon, kind, candidates=candidates)
            many = f" for each of {candidates} candidates" if candidates > 1 else ""
            raise RequestTooLarge(
                f"needs an estimated {est.describe()} for R={rows}{many}, a {prompt_tokens}-token prompt and "
                f"T={horizon} ({kind}); the memory budget is {self.budget / (1 << 20):.0f} MiB: "
                + (f"at most R={fit} fits" if fit else "no R fits; shorten the prompt or T"))
        return est

    def max_rows(self, prompt_tokens: int, horizon: int, kind: str = "coupled", limit: int = 1 << 20,
                 candidates: int = 1) -> int:
        """The largest R (per candidate) whose estimate fits the budget (0 if none), by bisection."""
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.estimate(mid, prompt_tokens, horizon, kind, candidates).total <= self.budget:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def info(self) -> dict[str, Any]:
        """What /info reports: the budget and the shapes it sizes requests with."""
        return {"memory_budget": self.budget, "kv_bytes_per_token": self.shape.kv_bytes_per_token,
                "shared_prompt": self.shared_prompt}


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
