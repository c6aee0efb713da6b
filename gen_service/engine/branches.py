"""The residual branches: from each row's branch point t*, P and Q decode apart for
K = min(W, T − t*) steps, maximally coupled, rows batched.

Two ways to reach Q's state at t*:

- **prefix** (:func:`prefix_branches`): since decoding never evicts, each row's P and
  Q caches at z_<t* are prefixes of the survival caches. Rows with different t* are
  batched together by masking each row's cache beyond its own prefix (a 2-D attention
  mask) and appending the branch tokens, at positions prompt + t* − 1 + k. No
  re-prefill and no snapshots; the price is attending over up to T masked slots. Rows
  leave the batch as their branch reaches K.
- **replay** (:func:`replay_branches`): when that shortcut does not hold — a press
  that compresses while decoding, a quantized cache, or layers keeping different
  numbers of tokens — both sides restart from a snapshot of their state right after
  prefill, every branch row re-feeds its own shared history z_<t* and then its branch
  tokens, all rows in lockstep, so a decoding press compresses each row at exactly the
  steps it did on the survival path. The price is up to T − 1 more forwards per side.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from gen_service.engine.context import LoopContext
from gen_service.engine.coupling import History, absorb_eos, maximal_coupling, probs
from gen_service.engine.readback import FiniteGuard
from gen_service.engine.sides import Forward, Side
from gen_service.engine.top_logprobs import LogitFields, logit_fields
from protocols import branch_record, wire_logits

__all__ = ["Branches", "prefix_branches", "replay_branches"]


class Branches:
    """Branch points, residual pairs and the records being filled, per replicate.

    The branch point and first pair are read to the host once (the survival path's
    end); each age's draws then stay on the device (:meth:`add` keeps the tensors) and
    are read back in one copy when the records are built (:meth:`records`), so the
    branch steps themselves never wait on the host.

    ``age0`` (a request with ``top_logprobs``): every row's logit traces at its branch point
    t* (a branch's age 0 is that survival step: the same two laws); :meth:`add` then keeps
    each later age's, computed on the device from the branch laws."""

    def __init__(self, t_star: torch.Tensor, x0: torch.Tensor, y0: torch.Tensor, tv_star: torch.Tensor,
                 W: int, T: int, age0: LogitFields | None = None):
        # one host copy of the four (rows,) values (float64 holds ids and float32 TVs exactly)
        ts, tvs, xs, ys = torch.stack([t_star.double(), tv_star.double(), x0.double(), y0.double()]).tolist()
        self.ts = [int(t) for t in ts]
        self.x0, self.y0 = x0, y0
        self.K = [min(W, T - t) if t > 0 else 0 for t in self.ts]
        self.rec = {r: ([tv], [int(x)], [int(y)]) for r, (t, tv, x, y) in
                    enumerate(zip(self.ts, tvs, xs, ys, strict=True)) if t > 0}
        self.rows = [r for r in self.rec if self.K[r] > 0]
        # (rows, batch positions, (3, n) draws, the age's logit traces on the device or None)
        self._ages: list[tuple[list[int], list[int], torch.Tensor, LogitFields | None]] = []
        self.k = age0.k if age0 is not None else 0
        first = age0.host() if age0 is not None else {}
        self.logits = {r: {name: [rows[r]] for name, rows in first.items()} for r in self.rec}

    def add(self, rows: list[int], d: Any, at: list[int] | None = None,
            laws: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Keep one age's draws for ``rows`` (positions ``at`` of the batch, default all); with
        logit traces, ``laws`` are the batch's (p, q) they are computed from, all rows at once."""
        lg = logit_fields(*laws, self.k) if self.k and laws is not None else None
        self._ages.append((rows, list(at) if at is not None else list(range(len(rows))),
                           torch.stack([d.tv.double(), d.x.double(), d.y.double()]), lg))

    def records(self, guard: FiniteGuard | None = None) -> Iterator[dict[str, Any]]:
        """Every branch's record; with ``guard``, its flags ride in the same host copy
        and a flagged branch step raises :class:`~gen_service.errors.NonFiniteLogits`
        before any branch record."""
        if self._ages:   # every age's draws in one device-to-host copy, appended in age order
            draws = torch.cat([v for _, _, v, _ in self._ages], 1)
            if guard is not None:
                flat = torch.cat([draws.flatten(), guard.take().double()]).tolist()
                cols = draws.shape[1]
                host = [flat[i * cols:(i + 1) * cols] for i in range(3)]
                failed = guard.failure(flat[3 * cols:])
                if failed is not None:
                    raise failed
            else:
                host = draws.tolist()
            col = 0
            for rows, at, v, lg in self._ages:
                lh = lg.host() if lg is not None else None
                for r, i in zip(rows, at, strict=True):
                    self.rec[r][0].append(host[0][col + i])
                    self.rec[r][1].append(int(host[1][col + i]))
                    self.rec[r][2].append(int(host[2][col + i]))
                    if lh is not None:
                        for name, values in lh.items():
                            self.logits[r][name].append(values[i])
                col += v.shape[1]
            self._ages = []
        for r in sorted(self.rec):
            tvs, xs, ys = self.rec[r]
            yield branch_record(r, self.ts[r], tvs, xs, ys, wire_logits(self.logits[r]) if self.k else None)


def _end(ctx: LoopContext, x: torch.Tensor) -> torch.Tensor:
    """The EOS id each branch's first token ended it on (-1: running)."""
    return ctx.ended(ctx.running(len(x)), x)


def prefix_branches(ctx: LoopContext, ps: Side, qs: Side, p_kept: list[int], q_kept: list[int], br: Branches,
                    h_star: torch.Tensor | None = None) -> Iterator[list[Forward]]:
    """Branches as prefixes of the survival caches (uniform, prefill-only presses).
    ``h_star`` holds each row's history counts at its branch point (prompt + z_<t*)."""
    dev = ctx.device
    rows = br.rows
    idx = torch.tensor(rows, dtype=torch.long, device=dev)
    tstar = torch.tensor([br.ts[r] for r in rows], dtype=torch.long, device=dev)
    # Row r's prefix z_<t* is the first kept + t* − 1 cache slots; crop to the longest
    # prefix needed and mask the rest per row.
    longest = max(br.ts[r] for r in rows) - 1
    masks = []
    for side, kept in ((ps, p_kept[0]), (qs, q_kept[0])):
        side.select(idx)
        side.crop([kept + longest] * len(side.cache.layers))
        slots = torch.arange(kept + longest, device=dev)
        masks.append((slots[None] < (kept + tstar - 1)[:, None]).long())
    # each branch's history: prompt + z_<t* + its own first token
    hp = hq = None
    if h_star is not None:
        hp, hq = History(h_star[idx]).add(br.x0[idx]), History(h_star[idx]).add(br.y0[idx])
    # head masks ride on kvpress's patched SDPA; eager attention would drop them
    eager = not (ps.masks or qs.masks)
    yield from _branch_loop(ctx, (ps, qs), rows, br, tstar, masks, (br.x0[idx], br.y0[idx]), (hp, hq), eager)


def _branch_loop(ctx: LoopContext, sides: tuple[Side, Side], rows: list[int], br: Branches, tstar: torch.Tensor,
                 masks: list[torch.Tensor], xy: tuple[torch.Tensor, torch.Tensor],
                 hists: tuple[History | None, History | None], eager: bool) -> Iterator[list[Forward]]:
    dev, sampling = ctx.device, ctx.job.sampling
    (ps, qs), (pmask, qmask), (x, y), (hp, hq) = sides, masks, xy, hists
    x_end, y_end = _end(ctx, x), _end(ctx, y)
    k = 0
    while rows:
        k += 1
        ctx.check()
        ones = torch.ones(len(rows), 1, dtype=torch.long, device=dev)
        pmask, qmask = torch.cat([pmask, ones], 1), torch.cat([qmask, ones], 1)
        lp, lq = yield [Forward(ps, x, ps.next_pos + tstar + k - 2, pmask, eager),
                        Forward(qs, y, qs.next_pos + tstar + k - 2, qmask, eager)]
        lp, lq = ctx.finite(None, f"branch step {k}", lp, lq)
        p = absorb_eos(probs(lp, sampling, hp), x_end >= 0, x_end)
        q = absorb_eos(probs(lq, sampling, hq), y_end >= 0, y_end)
        d = maximal_coupling(p, q, ctx.gen)
        if hp is not None:
            hp, hq = hp.add(d.x), hq.add(d.y)
        br.add(rows, d, laws=(p, q))
        x, y = d.x, d.y
        x_end, y_end = ctx.ended(x_end, x), ctx.ended(y_end, y)
        # Drop rows whose branch reached K = min(W, T − t*): the batch shrinks as
        # branches end instead of carrying finished rows to the longest one.
        live = [i for i, r in enumerate(rows) if br.K[r] > k]
        if len(live) < len(rows):
            sel = torch.tensor(live, dtype=torch.long, device=dev)
            rows = [rows[i] for i in live]
            if rows:
                ps.select(sel)
                qs.select(sel)
                pmask, qmask, tstar = pmask[sel], qmask[sel], tstar[sel]
                x, y, x_end, y_end = x[sel], y[sel], x_end[sel], y_end[sel]
                if hp is not None:
                    hp, hq = hp.select(sel), hq.select(sel)


def replay_branches(ctx: LoopContext, start: tuple[Side, Side], shared: torch.Tensor, br: Branches,
                    h0: History | None = None) -> Iterator[list[Forward]]:
    """Branches replayed from the post-prefill state: row r feeds z_1..z_{t*-1}, then its
    residual pair (X, Y) at step t*, then its own branch draws, all rows in lockstep.
    A decoding-time press thus compresses each row at the steps it did on the survival
    path, and each branch continues from Q's true state at t*. ``h0`` (the prompt's
    counts per replicate) starts each side's penalty history, which then grows by
    exactly the tokens that side is fed: prompt + z_<t* + its own branch, as on the
    non-replayed path."""
    dev, sampling = ctx.device, ctx.job.sampling
    rows = br.rows
    idx = torch.tensor(rows, dtype=torch.long, device=dev)
    ts = torch.tensor([br.ts[r] for r in rows], dtype=torch.long, device=dev)
    z = shared[idx]                                           # (B, T)
    ps, qs = start
    ps.rows(len(rows))
    qs.rows(len(rows))
    x, y = br.x0[idx], br.y0[idx]
    x_end, y_end = _end(ctx, x), _end(ctx, y)
    hp = hq = None if h0 is None else h0.select(idx)
    for s in range(1, max(br.ts[r] + br.K[r] - 1 for r in rows) + 1):
        ctx.check()
        before, at = s < ts, s == ts
        xin = torch.where(before, z[:, s - 1], torch.where(at, br.x0[idx], x))
        yin = torch.where(before, z[:, s - 1], torch.where(at, br.y0[idx], y))
        n = len(rows)
        lp, lq = yield [Forward(ps, xin, ctx.pos(ps, n, s)), Forward(qs, yin, ctx.pos(qs, n, s))]
        lp, lq = ctx.finite(None, f"branch replay step {s}", lp, lq)
        if hp is not None:
            hp, hq = hp.add(xin), hq.add(yin)
        p = absorb_eos(probs(lp, sampling, hp), x_end >= 0, x_end)
        q = absorb_eos(probs(lq, sampling, hq), y_end >= 0, y_end)
        d = maximal_coupling(p, q, ctx.gen)
        # which rows are inside their branch at replay step s, from the host's branch points
        active = [br.ts[r] <= s < br.ts[r] + br.K[r] for r in rows]
        br.add([r for r, a in zip(rows, active, strict=True) if a], d, [i for i, a in enumerate(active) if a],
               (p, q) if any(active) else None)
        on = (s >= ts)
        x, y = torch.where(on, d.x, x), torch.where(on, d.y, y)
        x_end, y_end = torch.where(on, ctx.ended(x_end, x), x_end), torch.where(on, ctx.ended(y_end, y), y_end)
