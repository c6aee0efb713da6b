"""The coupling math of docs/statistics.md §1, §2 and §5, batched over rows, in torch.

Everything here works on (rows, V) tensors on the model's device, so a step of
coupled decoding costs a handful of elementwise kernels next to the two forwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """Sampling transform applied identically to the P and Q logits (docs/statistics.md §1)."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    do_sample: bool = True

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0.0

    def as_dict(self) -> dict:
        return {"temperature": 0.0 if self.greedy else float(self.temperature),
                "top_k": self.top_k, "top_p": self.top_p, "do_sample": not self.greedy}


def probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Sampling distribution (rows, V) in float32 from raw logits.

    Greedy is the point mass on the argmax (ties: lowest id, as torch.argmax)."""
    logits = logits.float()
    if sampling.greedy:
        out = torch.zeros_like(logits)
        out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        return out
    if sampling.temperature != 1.0:
        logits = logits / sampling.temperature
    if sampling.top_k is not None and 0 < sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p is not None and 0.0 < sampling.top_p < 1.0:
        logits = _top_p(logits, sampling.top_p)
    return torch.softmax(logits, dim=-1)


def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    # Nucleus as transformers' TopPLogitsWarper: drop the low tail whose mass is
    # <= 1 - top_p, always keeping the most likely token.
    sorted_logits, idx = torch.sort(logits, descending=False, dim=-1)
    cum = sorted_logits.softmax(-1).cumsum(-1)
    remove_sorted = cum <= (1.0 - top_p)
    remove_sorted[..., -1] = False
    remove = remove_sorted.scatter(-1, idx, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def absorb_eos(p: torch.Tensor, done: torch.Tensor, eos: int | None) -> torch.Tensor:
    """EOS is absorbing: rows whose branch already emitted EOS get the point mass on EOS."""
    if eos is None or not bool(done.any()):
        return p
    p = p.clone()
    p[done] = 0.0
    p[done, eos] = 1.0
    return p


def tv(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """TV(p, q) per row. Computed as ½Σ|p−q| (equal to 1 − Σmin(p, q)) because it is
    exactly 0.0 in floating point when p == q, which 1 − Σmin is not."""
    return (0.5 * (p - q).abs().sum(-1)).clamp_(0.0, 1.0)


def _draw(weights: torch.Tensor, fallback: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One categorical draw per row from unnormalised weights; rows whose weights are
    all zero (rounding can empty a residual of mass ~1e-8) draw from ``fallback``."""
    empty = weights.sum(-1) <= 0
    if bool(empty.any()):
        weights = torch.where(empty[:, None], fallback, weights)
    return torch.multinomial(weights, 1, generator=gen).squeeze(-1)


@dataclass
class CoupledDraw:
    tv: torch.Tensor      # (rows,) δ
    x: torch.Tensor       # (rows,) token from P's side
    y: torch.Tensor       # (rows,) token from Q's side
    x_res: torch.Tensor   # (rows,) draw from (p−q)+/δ (kept for the residual branch)
    y_res: torch.Tensor   # (rows,) draw from (q−p)+/δ
    overlap: torch.Tensor  # (rows,) draw from min(p, q)/(1−δ)
    stop: torch.Tensor    # (rows,) no overlap mass at all (δ = 1): a survival path ends


def maximal_coupling(p: torch.Tensor, q: torch.Tensor, gen: torch.Generator) -> CoupledDraw:
    """docs/statistics.md §2 for every row at once.

    With probability 1 − δ both sides take one draw Z ~ min(p, q)/(1 − δ); otherwise
    X ~ (p − q)⁺/δ and Y ~ (q − p)⁺/δ independently. All three draws are made for
    every row (cheap, and keeps the generator's consumption independent of the
    outcome, hence reproducible), then selected."""
    delta = tv(p, q)
    m = torch.minimum(p, q)
    overlap = _draw(m, p, gen)
    x_res = _draw((p - q).clamp_min(0.0), p, gen)
    y_res = _draw((q - p).clamp_min(0.0), q, gen)
    # float64 uniforms: a float32 uniform is exactly 0 with probability 2^-24, which
    # would split rows whose TV is below that more often than TV says.
    u = torch.rand(p.shape[0], generator=gen, device=p.device, dtype=torch.float64)
    split = u < delta.double()
    x = torch.where(split, x_res, overlap)
    y = torch.where(split, y_res, overlap)
    stop = m.sum(-1) <= 0
    return CoupledDraw(delta, x, y, x_res, y_res, overlap, stop)
