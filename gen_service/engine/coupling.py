"""The coupling math of docs/statistics.md §1, §2 and §5, batched over rows, in torch.

Everything here works on (rows, V) tensors on the model's device, so a step of
coupled decoding costs a handful of elementwise kernels next to the two forwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gen_service.engine.jobs import Sampling

__all__ = ["History", "penalize", "probs", "absorb_eos", "ended_on", "tv", "categorical", "CoupledDraw",
           "maximal_coupling", "draw_seed", "seeded"]

#: bytes of float64 running sums :func:`categorical` holds at once (rows are taken in
#: blocks so that 1,280 rows of a 152k vocabulary do not need 1.5 GB beside the logits)
CDF_BYTES = 64 << 20
#: the same on the CPU, smaller: there a buffer above glibc's mmap threshold (32 MB at
#: most) is mapped afresh at every call, and its page faults cost more than the sums
#: (28 rows × 262,144, Gemma 3's draw: 44 ms in 64 MB passes, 16 ms in 4 MB;
#: benchmarks/bench_head_draws.py). CUDA's caching allocator has no such cost, and
#: there each pass is a few kernel launches, so it keeps the large passes.
CPU_CDF_BYTES = 4 << 20


@dataclass(frozen=True)
class History:
    """Token counts of one side's history, per row: prompt + tokens decoded so far.

    ``counts`` is (rows, V) float32. Records are immutable: :meth:`add` returns a new
    one, so a history kept for later (the residual branch point) cannot change.
    """

    counts: torch.Tensor

    @classmethod
    def start(cls, prompt_ids: list[int], rows: int, vocab: int, device: torch.device | str = "cpu") -> History:
        """The prompt's counts, repeated on ``rows`` rows."""
        counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        ids = torch.tensor(prompt_ids, dtype=torch.long, device=device)
        counts.index_add_(0, ids, torch.ones(len(prompt_ids), dtype=torch.float32, device=device))
        return cls(counts.expand(rows, -1).clone())

    def add(self, tokens: torch.Tensor) -> History:
        """The history after each row appended its token ``tokens[row]``."""
        return History(self.counts.scatter_add(-1, tokens[:, None].long(), torch.ones_like(tokens[:, None],
                                                                                         dtype=torch.float32)))

    def select(self, rows: torch.Tensor) -> History:
        """The rows ``rows`` only (rows leaving a batch)."""
        return History(self.counts[rows])


def penalize(logits: torch.Tensor, sampling: Sampling, history: History | None) -> torch.Tensor:
    """The history penalties on raw logits (rows, V); the identity without a history.

    Repetition (CTRL, as transformers and TGI): a seen token's logit is divided by the
    penalty when positive and multiplied when negative. Frequency and presence (as
    OpenAI defines them): ``logit − frequency·count − presence·[count > 0]``. Counts
    cover the prompt and the decoded tokens, as TGI's processors read all input ids.

    Parameters
    ----------
    logits : torch.Tensor
        (rows, V) float logits.
    sampling : Sampling
        The penalties to apply (unset ones are skipped).
    history : History or None
        Each row's token counts.

    Returns
    -------
    torch.Tensor
        (rows, V), finite (clamped to the float range).

    Raises
    ------
    RuntimeError
        If the history's shape does not match the logits'.

    Examples
    --------
    >>> h = History.start([0], 1, 2)
    >>> penalize(torch.tensor([[2.0, 1.0]]), Sampling(repetition_penalty=2.0), h).tolist()
    [[1.0, 1.0]]
    """
    if history is None or not sampling.uses_history:
        return logits
    counts = history.counts
    seen = counts > 0
    if sampling.repetition_penalty not in (None, 1.0):
        r = sampling.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    if sampling.frequency_penalty not in (None, 0.0):
        logits = logits - sampling.frequency_penalty * counts
    if sampling.presence_penalty not in (None, 0.0):
        logits = logits - sampling.presence_penalty * seen.float()
    # a tiny repetition penalty overflows logit / r to ±inf, and inf − inf is NaN in
    # the softmax; clamped, the limit law (mass on the largest logits) comes out
    big = torch.finfo(logits.dtype).max
    return logits.clamp(-big, big)


# 1/T is capped here: for any T below 1e-30 the scaled gaps between distinct float32
# logits are already below -1e20, so softmax gives the T -> 0 limit (uniform over the
# maximal logits) exactly; an uncapped 1/T overflows float32 and 0 * inf is NaN.
_MAX_INVERSE_TEMPERATURE = 1e30


def probs(logits: torch.Tensor, sampling: Sampling, history: History | None = None) -> torch.Tensor:
    """Sampling distribution (rows, V) in float32 from raw logits.

    Greedy is the point mass on the argmax (ties: lowest id, as torch.argmax).

    Parameters
    ----------
    logits : torch.Tensor
        (rows, V) raw logits.
    sampling : Sampling
        The transforms, applied in TGI's order (penalties, temperature, top-k, top-p,
        typical-p).
    history : History, optional
        Each row's token counts; needed only when ``sampling.uses_history``.

    Returns
    -------
    torch.Tensor
        (rows, V) float32, rows summing to 1.

    Raises
    ------
    RuntimeError
        If the history's shape does not match the logits'.

    Examples
    --------
    >>> probs(torch.tensor([[2.0, 1.0]]), Sampling(do_sample=False)).tolist()
    [[1.0, 0.0]]
    """
    logits = penalize(logits.float(), sampling, history)
    if sampling.greedy:
        out = torch.zeros_like(logits)
        out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        return out
    if sampling.temperature != 1.0:
        # shift by the max first: the scaled logits are then <= 0 and cannot overflow
        inverse = min(1.0 / sampling.temperature, _MAX_INVERSE_TEMPERATURE)
        logits = (logits - logits.amax(-1, keepdim=True)) * inverse
    if sampling.top_k is not None and 0 < sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p is not None and 0.0 < sampling.top_p < 1.0:
        logits = _top_p(logits, sampling.top_p)
    if sampling.typical_p is not None and 0.0 < sampling.typical_p < 1.0:
        logits = _typical_p(logits, sampling.typical_p)
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


def _typical_p(logits: torch.Tensor, mass: float) -> torch.Tensor:
    # Locally typical sampling as transformers' TypicalLogitsWarper: keep the tokens
    # whose surprisal is closest to the entropy until their mass reaches `mass`.
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    entropy = -(torch.where(p > 0, logp * p, torch.zeros_like(p))).sum(-1, keepdim=True)
    shifted = (-logp - entropy).abs()
    sorted_shifted, idx = torch.sort(shifted, dim=-1)
    cum = logits.gather(-1, idx).softmax(-1).cumsum(-1)
    last = (cum < mass).sum(-1, keepdim=True).clamp_(max=logits.shape[-1] - 1)
    remove_sorted = sorted_shifted > sorted_shifted.gather(-1, last)
    remove_sorted[..., 0] = False
    remove = remove_sorted.scatter(-1, idx, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def absorb_eos(p: torch.Tensor, done: torch.Tensor, eos: int | torch.Tensor | None) -> torch.Tensor:
    """EOS is absorbing: rows whose branch already emitted EOS get the point mass on EOS.

    A model may have several EOS ids (Llama-3.1: ``<|end_of_text|>``, ``<|eom_id|>``,
    ``<|eot_id|>``); an ended row then keeps emitting *the id it emitted*, so pass the
    per-row ids (:func:`ended_on`) and its token arrays stay constant after the end.

    Parameters
    ----------
    p : torch.Tensor
        (rows, V) laws.
    done : torch.Tensor
        (rows,) bool, the branch has emitted EOS.
    eos : int, torch.Tensor or None
        The EOS id, or (rows,) ids: the one each done row emitted (None: nothing to do).

    Returns
    -------
    torch.Tensor
        ``p``, or a copy with the done rows replaced.

    Raises
    ------
    RuntimeError
        If an EOS id is outside the vocabulary.

    Examples
    --------
    >>> absorb_eos(torch.tensor([[0.5, 0.5]]), torch.tensor([True]), 1).tolist()
    [[0.0, 1.0]]
    >>> absorb_eos(torch.full((2, 3), 1 / 3), torch.tensor([True, True]), torch.tensor([2, 0])).tolist()
    [[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]
    """
    if eos is None:
        return p
    # branchless (no host read of ``done``): every row's point mass, kept where done;
    # the same values as replacing the done rows, with no device-to-host round-trip
    if isinstance(eos, torch.Tensor):
        ids = eos.to(p.device).clamp_min(0)     # running rows hold -1: any valid id, not kept
    else:
        ids = torch.full(done.shape, int(eos), dtype=torch.long, device=p.device)
    point = torch.zeros_like(p).scatter_(-1, ids[:, None], 1.0)
    return torch.where(done[:, None], point, p)


def ended_on(end: torch.Tensor, tokens: torch.Tensor, eos: torch.Tensor | None) -> torch.Tensor:
    """Each row's EOS id once it has emitted one of ``eos`` (-1 while it runs).

    Parameters
    ----------
    end : torch.Tensor
        (rows,) long, the ids so far (-1: running).
    tokens : torch.Tensor
        (rows,) long, this step's tokens.
    eos : torch.Tensor or None
        The model's EOS ids (None or empty: no EOS).

    Returns
    -------
    torch.Tensor
        ``end`` with rows that emitted an EOS id now holding it (an ended row
        emits its own id again, so it keeps it).

    Raises
    ------
    RuntimeError
        If the shapes of ``end`` and ``tokens`` differ.

    Examples
    --------
    >>> ended_on(torch.tensor([-1, -1, 9]), torch.tensor([7, 3, 9]), torch.tensor([2, 7, 9])).tolist()
    [7, -1, 9]
    """
    if eos is None or not eos.numel():
        return end
    hit = torch.isin(tokens, eos) & (end < 0)
    return torch.where(hit, tokens, end)


def tv(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """TV(p, q) per row.

    Computed as ½Σ|p−q| (equal to 1 − Σmin(p, q)) because it is exactly 0.0 in
    floating point when p == q, which 1 − Σmin is not.

    Parameters
    ----------
    p, q : torch.Tensor
        (rows, V) laws.

    Returns
    -------
    torch.Tensor
        (rows,) in [0, 1].

    Raises
    ------
    RuntimeError
        If the shapes differ.

    Examples
    --------
    >>> tv(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.5, 0.5]])).tolist()
    [0.5]
    """
    return (0.5 * (p - q).abs().sum(-1)).clamp_(0.0, 1.0)


def categorical(weights: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One draw per row from unnormalised (rows, V) weights, by the inverse CDF.

    Each row takes one float64 uniform u from ``gen`` and returns the first token whose
    running sum (in float64) exceeds u times the row's total: token v with probability
    w_v / Σw, a zero weight never drawn. It replaces ``torch.multinomial``, whose
    one-sample draw makes an exponential variate per *entry* (262k per row for Gemma 3):
    at 28 rows × 262,144 entries on the 2-core CPU it took 262 ms against 46 ms
    (``benchmarks/bench_head_draws.py``; docs/measurements.md, "The head's layout and the
    draws on the CPU, measured"). Rows are independent (a row's draw reads its own
    weights and its own uniform), and the generator's use is one uniform per row whatever the
    weights: reproducible, and the same on every device.

    Parameters
    ----------
    weights : torch.Tensor
        (rows, V), non-negative and finite, each row with some positive weight.
    gen : torch.Generator
        The request's generator (on the weights' device).

    Returns
    -------
    torch.Tensor
        (rows,) int64 token ids.

    Raises
    ------
    ValueError
        If ``weights`` is not two-dimensional (from the unpacking of its shape).

    Examples
    --------
    >>> categorical(torch.tensor([[0.0, 2.0, 0.0], [1.0, 0.0, 0.0]]), torch.Generator().manual_seed(0)).tolist()
    [1, 0]
    """
    rows, V = weights.shape
    u = torch.rand(rows, 1, generator=gen, device=weights.device, dtype=torch.float64)
    budget = CPU_CDF_BYTES if weights.device.type == "cpu" else CDF_BYTES
    block = max(1, budget // (8 * max(V, 1)))
    out = []
    for i in range(0, rows, block):
        cdf = weights[i:i + block].double().cumsum(-1)
        total = cdf[:, -1:]
        # strictly below the total, so that some running sum exceeds it: the row's last
        # positive weight at worst (u * total can round up to the total when u ~ 1 - 2^-53)
        target = torch.minimum(u[i:i + block] * total, torch.nextafter(total, torch.zeros_like(total)))
        out.append(torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_max_(V - 1))
    return out[0] if len(out) == 1 else torch.cat(out)


def _draw(weights: torch.Tensor, fallback: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One categorical draw per row from unnormalised weights; rows whose weights are
    all zero (rounding can empty a residual of mass ~1e-8) draw from ``fallback``."""
    empty = weights.sum(-1) <= 0
    # always selected (no host read of ``empty``): the same weights, no round-trip
    weights = torch.where(empty[:, None], fallback, weights)
    return categorical(weights, gen)


@dataclass(frozen=True)
class CoupledDraw:
    """One coupled step for every row (docs/statistics.md §2)."""

    tv: torch.Tensor      # (rows,) δ
    x: torch.Tensor       # (rows,) token from P's side
    y: torch.Tensor       # (rows,) token from Q's side
    x_res: torch.Tensor   # (rows,) draw from (p−q)+/δ (kept for the residual branch)
    y_res: torch.Tensor   # (rows,) draw from (q−p)+/δ
    overlap: torch.Tensor  # (rows,) draw from min(p, q)/(1−δ)
    stop: torch.Tensor    # (rows,) no overlap mass at all (δ = 1): a survival path ends


def maximal_coupling(p: torch.Tensor, q: torch.Tensor, gen: torch.Generator) -> CoupledDraw:
    """The stepwise maximal coupling (docs/statistics.md §2) for every row at once.

    With probability 1 − δ both sides take one draw Z ~ min(p, q)/(1 − δ); otherwise
    X ~ (p − q)⁺/δ and Y ~ (q − p)⁺/δ independently. All three draws are made for
    every row (cheap, and keeps the generator's consumption independent of the
    outcome, hence reproducible), then selected.

    Parameters
    ----------
    p, q : torch.Tensor
        (rows, V) post-transform laws of P and Q.
    gen : torch.Generator
        The request's generator.

    Returns
    -------
    CoupledDraw

    Raises
    ------
    RuntimeError
        If a law has no mass at all.

    Examples
    --------
    >>> p = torch.tensor([[1.0, 0.0]])
    >>> maximal_coupling(p, p, torch.Generator().manual_seed(0)).tv.tolist()
    [0.0]
    """
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


def draw_seed() -> int:
    """A seed for a request that gave none (torch's global generator).

    Parameters
    ----------
    None

    Returns
    -------
    int
        In [0, 2**31 - 1).

    Raises
    ------
    None

    Examples
    --------
    >>> 0 <= draw_seed() < 2**31 - 1
    True
    """
    return int(torch.randint(0, 2**31 - 1, ()).item())


def seeded(device: torch.device, seed: int) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``: one per candidate (its draws are its own).

    Parameters
    ----------
    device : torch.device
        Where the draws happen (the model's device).
    seed : int
        The candidate's seed.

    Returns
    -------
    torch.Generator

    Raises
    ------
    None

    Examples
    --------
    >>> a, b = seeded(torch.device("cpu"), 7), seeded(torch.device("cpu"), 7)
    >>> bool(torch.rand(3, generator=a).equal(torch.rand(3, generator=b)))
    True
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed))
    return gen
