"""Logit traces on device (docs/contract.md §1, "Logit traces"): one step's top-k and KL/entropy.

A request with ``top_logprobs: k`` gets, at every step and for every row, P's and Q's top-k
tokens of the *processed* laws the coupling uses (:func:`gen_service.engine.coupling.probs`, after
absorbing EOS), each model's log-probability of both top-k sets, and KL(P‖Q), KL(Q‖P), H(P),
H(Q) on the whole vocabulary. :func:`logit_fields` computes all of it for every row at once
in a few (rows, V) kernels; :meth:`LogitFields.host` brings it over in two copies (ids,
values), never one per row. Every decoding loop calls :func:`step_logits` (the coupled
loop, the residual survival path and branches; a reference loop calls it the same way
with its two laws).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from protocols.logit_fields import LOGIT_SUMMARIES, wire_logits

__all__ = ["LogitFields", "PendingLogits", "at_steps", "logit_fields", "step_logits"]

# The value columns of LogitFields.values, in order: four top-k blocks of k, then the summaries.
_TOP_VALUES = ("p_top_logp", "p_top_logq", "q_top_logq", "q_top_logp")


@dataclass(frozen=True)
class LogitFields:
    """One step's logit traces for every row, still on the device.

    ``tokens`` is (rows, 2k) long: P's top-k ids then Q's; ``values`` is (rows, 4k + 4)
    float32: log p and log q at P's top-k, log q and log p at Q's top-k, then KL(P‖Q),
    KL(Q‖P), H(P), H(Q).
    """

    tokens: torch.Tensor
    values: torch.Tensor
    k: int

    def host(self) -> dict[str, list[Any]]:
        """Every field as per-row Python lists (:data:`protocols.logit_fields.LOGIT_FIELDS`): two copies."""
        k = self.k
        ids, vals = self.tokens.tolist(), self.values.tolist()
        out: dict[str, list[Any]] = {"p_top_token": [r[:k] for r in ids], "q_top_token": [r[k:] for r in ids]}
        for j, name in enumerate(_TOP_VALUES):
            out[name] = [r[j * k:(j + 1) * k] for r in vals]
        for j, name in enumerate(LOGIT_SUMMARIES):
            out[name] = [r[4 * k + j] for r in vals]
        return out


def logit_fields(p: torch.Tensor, q: torch.Tensor, k: int) -> LogitFields:
    """P's and Q's top-k and the full-vocabulary KL and entropies of (rows, V) laws.

    Parameters
    ----------
    p, q : torch.Tensor
        (rows, V) processed laws of P and Q (rows summing to 1).
    k : int
        The top-k size, 1..V.

    Returns
    -------
    LogitFields
        On the laws' device. A log-probability of 0 mass is -inf; KL(P‖Q) is +inf where P
        has mass Q lacks (and KL(Q‖P) the other way round).

    Raises
    ------
    ValueError
        ``k`` outside 1..V, or laws of different shapes.

    Examples
    --------
    >>> f = logit_fields(torch.tensor([[0.5, 0.5, 0.0]]), torch.tensor([[0.25, 0.25, 0.5]]), 2)
    >>> h = f.host()
    >>> h["q_top_token"][0][0], round(h["kl_pq"][0], 4), h["kl_qp"][0]
    (2, 0.6931, inf)
    """
    if p.shape != q.shape or p.ndim != 2 or not 1 <= k <= p.shape[-1]:
        raise ValueError(f"logit_fields: laws of shapes {tuple(p.shape)}, {tuple(q.shape)} and k = {k} "
                         "(need equal (rows, V) shapes and 1 <= k <= V)")
    p, q = p.float(), q.float()
    lp, lq = p.log(), q.log()     # -inf where the mass is 0
    p_ids = torch.topk(p, k, dim=-1).indices
    q_ids = torch.topk(q, k, dim=-1).indices
    # p · (log p − log q) is +inf where q = 0 < p and NaN where p = 0 (0 · ∞): the where drops the latter
    kl_pq = torch.where(p > 0, p * (lp - lq), torch.zeros_like(p)).sum(-1)
    kl_qp = torch.where(q > 0, q * (lq - lp), torch.zeros_like(q)).sum(-1)
    h_p = -torch.where(p > 0, p * lp, torch.zeros_like(p)).sum(-1)
    h_q = -torch.where(q > 0, q * lq, torch.zeros_like(q)).sum(-1)
    values = torch.cat([lp.gather(-1, p_ids), lq.gather(-1, p_ids), lq.gather(-1, q_ids), lp.gather(-1, q_ids),
                        torch.stack([kl_pq, kl_qp, h_p, h_q], -1)], -1)
    return LogitFields(torch.cat([p_ids, q_ids], -1), values, k)


def at_steps(steps: list[LogitFields], t: torch.Tensor) -> LogitFields:
    """Row r's fields at step ``t[r]`` (1-based; rows with t = 0 get step 1's, to be ignored), in one gather.

    The residual loop keeps each survival step's fields on the device and takes each row's at
    its branch point t*: a branch's age 0 is that step (the same two laws).

    Parameters
    ----------
    steps : list of LogitFields
        The fields of steps 1..T, every row.
    t : torch.Tensor
        (rows,) long, the step per row.

    Returns
    -------
    LogitFields

    Raises
    ------
    IndexError
        A step beyond ``len(steps)``.

    Examples
    --------
    >>> a = logit_fields(torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 0.0]]), 1)
    >>> b = logit_fields(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.0, 1.0]]), 1)
    >>> at_steps([a, b], torch.tensor([2])).host()["p_top_token"]
    [[1]]
    """
    rows = torch.arange(len(t), device=t.device)
    at = (t - 1).clamp_min(0)
    return LogitFields(torch.stack([s.tokens for s in steps])[at, rows],
                       torch.stack([s.values for s in steps])[at, rows], steps[0].k)


def step_logits(p: torch.Tensor, q: torch.Tensor, k: int,
                observed: list[bool] | None = None) -> dict[str, list[Any]] | None:
    """The ``logits`` object of one step record (None when the request asked for none, k = 0).

    Parameters
    ----------
    p, q : torch.Tensor
        (rows, V) processed laws of P and Q.
    k : int
        ``top_logprobs``; 0 for none.
    observed : list of bool, optional
        Rows the record shows (a residual survival path after it stopped is ``null``).

    Returns
    -------
    dict or None
        JSON-safe (:func:`protocols.logit_fields.wire_logits`).

    Raises
    ------
    ValueError
        As :func:`logit_fields`.

    Examples
    --------
    >>> step_logits(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.5, 0.5]]), 1)["kl_pq"]
    [0.6931471824645996]
    """
    if not k:
        return None
    return wire_logits(logit_fields(p, q, k).host(), observed)


class PendingLogits:
    """A loop's logit traces kept on the device until their step's record is built.

    The loops build records only when their :class:`~gen_service.engine.readback.Readback`
    copies a batch of steps to the host (every k steps), so a step's fields wait here,
    computed on the device when the step is drawn, and go to the host as the record is
    built; with ``k = 0`` (no logit traces asked for) nothing is kept or computed.

    Parameters
    ----------
    k : int
        ``top_logprobs``; 0 for none.

    Examples
    --------
    >>> later = PendingLogits(1)
    >>> later.keep(1, torch.tensor([[1.0, 0.0]]), torch.tensor([[0.5, 0.5]]))
    >>> later.wire(1)["kl_pq"]
    [0.6931471824645996]
    >>> PendingLogits(0).wire(1) is None
    True
    """

    def __init__(self, k: int):
        self.k = k
        self.steps: dict[int, LogitFields] = {}

    def keep(self, t: int, p: torch.Tensor, q: torch.Tensor) -> None:
        """Compute step ``t``'s fields from its (rows, V) laws, on their device."""
        if self.k:
            self.steps[t] = logit_fields(p, q, self.k)

    def wire(self, t: int, observed: list[bool] | None = None) -> dict[str, list[Any]] | None:
        """Step ``t``'s ``logits`` object (:func:`step_logits`), or None without logit traces."""
        fields = self.steps.pop(t, None)
        return None if fields is None else wire_logits(fields.host(), observed)

