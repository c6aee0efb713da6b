"""Batched coupled and residual-branch decoding producing ``kvdiv.trace/1`` records.

One request = one prompt, a reference policy (P, default ``full``) and a candidate
policy (Q). The prompt is prefilled once per policy (P full, Q compressed by its
press during prefill); both caches are then expanded to R rows and every decoding
step runs one forward per model over all R rows, with explicit ``position_ids``
(prompt length + step − 1): the evicted cache is shorter than the sequence, and
letting transformers infer positions from the cache length would shift RoPE.

Residual mode (docs/statistics.md §5) in three phases, all batched over rows:

1. survival: both models decode the shared history z for T steps; each step records
   δ_t, draws z_t from min(p, q)/(1 − δ_t) and also draws the residual pair
   X ~ (p − q)⁺/δ, Y ~ (q − p)⁺/δ;
2. the branch point t* ~ π_t/(1 − S_T) is drawn *online* by weighted reservoir
   sampling (replace the current candidate with probability π_t / Σ_{s≤t} π_s), so
   the residual pair at t* is already in hand without storing (R, T, V) distributions;
3. branches: since decoding never evicts, each row's P and Q caches at z_<t* are
   prefixes of the survival caches. Rows with different t* are batched together by
   masking each row's cache beyond its own prefix (a 2-D attention mask) and
   appending the branch tokens, at positions prompt + t* − 1 + k. No re-prefill and
   no snapshots; the price is attending over up to T masked slots. Rows leave the
   batch as their branch reaches K = min(W, T − t*).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from gen_service.coupling import History, Sampling, absorb_eos, maximal_coupling, probs
from gen_service.errors import ServiceError
from gen_service.models import LoadedModel
from gen_service.presses import Plan, Policy, PolicyError, PolicyRegistry

PRODUCER = "kvdiv.gen_service"


class Cancelled(ServiceError):
    """The client went away; work stops between steps."""


@dataclass
class TraceJob:
    """A validated ``/v1/traces`` request."""

    prompt_ids: list[int]
    candidate: str
    reference: str = "full"
    kind: str = "coupled"
    horizon: int = 32
    replicates: int = 1
    window: int | None = None
    sampling: Sampling = field(default_factory=Sampling)
    seed: int | None = None
    doc: str | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class Prefilled:
    """One policy's prompt cache (batch 1) and the step-1 logits."""

    cache: DynamicCache
    logits: torch.Tensor   # (1, V)
    kept: int              # tokens in the cache (layer 0) after compression
    plan: Plan


def _lengths(cache: DynamicCache) -> list[int]:
    return [layer.keys.shape[-2] for layer in cache.layers]


class Engine:
    """Runs prefill and decoding for one loaded model. Not thread-safe: the app runs
    all model work on one worker thread."""

    def __init__(self, lm: LoadedModel, registry: PolicyRegistry | None = None):
        self.lm = lm
        self.model = lm.model
        self.registry = registry or PolicyRegistry()
        self.device = lm.device

    # ------------------------------------------------------------------ basics

    def generator(self, seed: int) -> torch.Generator:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(int(seed))
        return gen

    @torch.inference_mode()
    def prefill(self, policy: Policy, prompt_ids: list[int]) -> Prefilled:
        """Prefill under the policy's press: the forward attends to the whole prompt and
        each layer's cache is compressed right after that layer, so the returned
        logits are the full model's whatever the press."""
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        plan = policy.plan(len(prompt_ids))
        cache = DynamicCache()
        positions = torch.arange(len(prompt_ids), device=self.device)[None]
        if plan.press is None:
            out = self.model(input_ids=ids, past_key_values=cache, position_ids=positions, logits_to_keep=1)
        else:
            with plan.press(self.model):
                out = self.model(input_ids=ids, past_key_values=cache, position_ids=positions, logits_to_keep=1)
            self._refuse_headwise(policy)
        return Prefilled(cache, out.logits[:, -1].float(), _lengths(cache)[0], plan)

    @torch.inference_mode()
    def prefill_pair(self, ref: Policy, cand: Policy, prompt_ids: list[int]) -> tuple[Prefilled, Prefilled]:
        """P's and Q's prompt caches. With a full reference both come from ONE forward:
        compression does not change a layer's output (it runs after the layer has
        attended to the whole prompt), so hooks registered before the press's keep
        each layer's uncompressed keys/values for P while the press compresses Q's."""
        L = len(prompt_ids)
        ref_plan = ref.plan(L)
        if ref_plan.press is not None:
            return self.prefill(ref, prompt_ids), self.prefill(cand, prompt_ids)
        full: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def keep(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            layer = kwargs["past_key_values"].layers[module.layer_idx]
            # clone: a press may edit the tensors it is handed
            full[module.layer_idx] = (layer.keys.clone(), layer.values.clone())

        hooks = [layer.self_attn.register_forward_hook(keep, with_kwargs=True) for layer in self.model.model.layers]
        try:
            q0 = self.prefill(cand, prompt_ids)
        finally:
            for hook in hooks:
                hook.remove()
        cache = DynamicCache()
        for idx in sorted(full):
            cache.update(*full[idx], idx)
        return Prefilled(cache, q0.logits, L, ref_plan), q0

    def _refuse_headwise(self, policy: Policy) -> None:
        # kvpress's head-wise presses (AdaKV & co.) leave per-module masks for batch 1
        # on the shared model; they would leak into the other policy's forwards.
        for layer in self.model.model.layers:
            if getattr(layer.self_attn, "masked_key_indices", None) is not None:
                for lyr in self.model.model.layers:
                    lyr.self_attn.masked_key_indices = None
                raise PolicyError(f"policy {policy.spec.id!r}: head-wise presses are not supported")

    @torch.inference_mode()
    def step(self, cache: DynamicCache, tokens: torch.Tensor, positions: torch.Tensor,
             mask: torch.Tensor | None = None) -> torch.Tensor:
        """One decoding forward over all rows: (rows,) tokens -> (rows, V) float logits."""
        out = self.model(input_ids=tokens[:, None], past_key_values=cache, position_ids=positions[:, None],
                         attention_mask=mask, use_cache=True)
        return out.logits[:, -1].float()

    # ------------------------------------------------------------------ traces

    def header(self, job: TraceJob, seed: int, cand: Policy, ref: Policy, p0: Prefilled,
               q0: Prefilled) -> dict[str, Any]:
        from protocols import header_record, prompt_digest

        candidate = cand.describe()
        candidate.update(params=q0.plan.params, note=q0.plan.note)
        reference = ref.describe()
        return header_record(
            kind=job.kind, horizon=job.horizon, window=job.window or job.horizon, model=self.lm.name,
            eos_token_id=self.lm.eos_token_id, sampling=job.sampling.as_dict(), candidate=candidate,
            reference=reference, seed=seed, prompt_tokens=len(job.prompt_ids),
            prompt_sha256=prompt_digest(job.prompt_ids), retained_tokens=q0.kept,
            replicates=job.replicates, vocab_size=self.lm.vocab_size, doc=job.doc, request_id=job.request_id,
            coupling="stepwise-maximal", producer=PRODUCER, reference_retained_tokens=p0.kept,
        )

    def trace(self, job: TraceJob, cancelled: Callable[[], bool] = lambda: False) -> Iterator[dict[str, Any]]:
        """Yield the stream's records (header, steps / shared steps + branches); the
        caller adds the ``end`` record (it owns the digest)."""
        seed = job.seed if job.seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
        cand = self.registry.resolve(job.candidate)
        ref = self.registry.resolve(job.reference)
        p0, q0 = self.prefill_pair(ref, cand, job.prompt_ids)
        yield self.header(job, seed, cand, ref, p0, q0)
        gen = self.generator(seed)
        if job.kind == "coupled":
            yield from self._coupled(job, p0, q0, gen, cancelled)
        else:
            yield from self._residual(job, p0, q0, gen, cancelled)

    def _expand(self, pre: Prefilled, rows: int) -> DynamicCache:
        pre.cache.batch_repeat_interleave(rows)
        return pre.cache

    def _history(self, sampling: Sampling, prompt_ids: list[int], rows: int, vocab: int) -> History | None:
        """Each side's token counts for the history penalties; None (free) when none is set."""
        if not sampling.uses_history:
            return None
        return History.start(prompt_ids, rows, vocab, self.device)

    def _check(self, cancelled: Callable[[], bool]) -> None:
        if cancelled():
            raise Cancelled()

    def _coupled(self, job: TraceJob, p0: Prefilled, q0: Prefilled, gen: torch.Generator,
                 cancelled: Callable[[], bool]) -> Iterator[dict[str, Any]]:
        from protocols import step_record

        R, T, L = job.replicates, job.horizon, len(job.prompt_ids)
        eos = self.lm.eos_token_id
        pc, qc = self._expand(p0, R), self._expand(q0, R)
        lp, lq = p0.logits.expand(R, -1), q0.logits.expand(R, -1)
        x_done = torch.zeros(R, dtype=torch.bool, device=self.device)
        y_done = torch.zeros_like(x_done)
        # P and Q are penalised by their own histories (prompt + x_<t, prompt + y_<t)
        hp = hq = self._history(job.sampling, job.prompt_ids, R, lp.shape[-1])
        for t in range(1, T + 1):
            self._check(cancelled)
            p = absorb_eos(probs(lp, job.sampling, hp), x_done, eos)
            q = absorb_eos(probs(lq, job.sampling, hq), y_done, eos)
            d = maximal_coupling(p, q, gen)
            if hp is not None:
                hp, hq = hp.add(d.x), hq.add(d.y)
            yield step_record(t, d.tv.tolist(), d.x.tolist(), d.y.tolist())
            if eos is not None:
                x_done |= d.x == eos
                y_done |= d.y == eos
            if t < T:
                pos = torch.full((R,), L + t - 1, dtype=torch.long, device=self.device)
                lp = self.step(pc, d.x, pos)
                lq = self.step(qc, d.y, pos)

    def _residual(self, job: TraceJob, p0: Prefilled, q0: Prefilled, gen: torch.Generator,
                  cancelled: Callable[[], bool]) -> Iterator[dict[str, Any]]:
        from protocols import shared_step_record

        R, T, L = job.replicates, job.horizon, len(job.prompt_ids)
        W = job.window or T
        eos = self.lm.eos_token_id
        dev = self.device
        pc, qc = self._expand(p0, R), self._expand(q0, R)
        lp, lq = p0.logits.expand(R, -1), q0.logits.expand(R, -1)
        z_done = torch.zeros(R, dtype=torch.bool, device=dev)
        alive = torch.ones(R, dtype=torch.bool, device=dev)       # survival path not stopped
        surv = torch.ones(R, dtype=torch.float64, device=dev)     # S_{t-1}
        mass = torch.zeros(R, dtype=torch.float64, device=dev)    # Σ_{s≤t} π_s
        t_star = torch.zeros(R, dtype=torch.long, device=dev)
        x0 = torch.zeros(R, dtype=torch.long, device=dev)
        y0 = torch.zeros(R, dtype=torch.long, device=dev)
        tv_star = torch.zeros(R, dtype=torch.float64, device=dev)
        # history penalties: both sides share prompt + z_<t; each row keeps its counts
        # at t* so its two branches continue from their own histories
        hz = self._history(job.sampling, job.prompt_ids, R, lp.shape[-1])
        h_star = None if hz is None else torch.zeros_like(hz.counts)
        for t in range(1, T + 1):
            self._check(cancelled)
            p = absorb_eos(probs(lp, job.sampling, hz), z_done, eos)
            q = absorb_eos(probs(lq, job.sampling, hz), z_done, eos)
            d = maximal_coupling(p, q, gen)
            delta = d.tv.double()
            pi = torch.where(alive, surv * delta, torch.zeros_like(surv))
            mass += pi
            # weighted reservoir sampling of t* ~ π / Σπ, one candidate per row
            u = torch.rand(R, generator=gen, device=dev, dtype=torch.float64)
            take = (pi > 0) & (u * mass < pi)
            t_star = torch.where(take, t, t_star)
            x0 = torch.where(take, d.x_res, x0)
            y0 = torch.where(take, d.y_res, y0)
            tv_star = torch.where(take, delta, tv_star)
            if hz is not None:
                h_star = torch.where(take[:, None], hz.counts, h_star)
                hz = hz.add(d.overlap)
            # The step where a path stops keeps its TV (1) but has no token: min(p, q) is
            # empty, so there is no Z to draw; later steps are null altogether.
            shown, has_token = alive.tolist(), (alive & ~d.stop).tolist()
            yield shared_step_record(
                t, [v if a else None for v, a in zip(d.tv.tolist(), shown)],
                [v if a else None for v, a in zip(d.overlap.tolist(), has_token)])
            surv = torch.where(alive, surv * (1.0 - delta), surv)
            alive &= ~d.stop
            if eos is not None:
                z_done |= d.overlap == eos
            if t < T:
                pos = torch.full((R,), L + t - 1, dtype=torch.long, device=dev)
                lp = self.step(pc, d.overlap, pos)
                lq = self.step(qc, d.overlap, pos)
        yield from self._branches(job, pc, qc, p0.kept, q0.kept, t_star, x0, y0, tv_star, W, gen, cancelled,
                                  h_star)

    def _branches(self, job: TraceJob, pc: DynamicCache, qc: DynamicCache, p_kept: int, q_kept: int,
                  t_star: torch.Tensor, x0: torch.Tensor, y0: torch.Tensor, tv_star: torch.Tensor, W: int,
                  gen: torch.Generator, cancelled: Callable[[], bool],
                  h_star: torch.Tensor | None = None) -> Iterator[dict[str, Any]]:
        from protocols import branch_record

        T, L = job.horizon, len(job.prompt_ids)
        eos = self.lm.eos_token_id
        ts, tv0, xs0, ys0 = t_star.tolist(), tv_star.tolist(), x0.tolist(), y0.tolist()
        K = [min(W, T - t) if t > 0 else 0 for t in ts]
        rec = {r: ([tv0[r]], [xs0[r]], [ys0[r]]) for r, t in enumerate(ts) if t > 0}
        rows = [r for r in rec if K[r] > 0]
        if rows:
            self._run_branches(job, pc, qc, p_kept, q_kept, rows, ts, K, x0, y0, rec, gen, cancelled, h_star)
        for r in sorted(rec):
            tvs, xs, ys = rec[r]
            yield branch_record(r, ts[r], tvs, xs, ys)

    def _run_branches(self, job: TraceJob, pc: DynamicCache, qc: DynamicCache, p_kept: int, q_kept: int,
                      rows: list[int], ts: list[int], K: list[int], x0: torch.Tensor, y0: torch.Tensor,
                      rec: dict, gen: torch.Generator, cancelled: Callable[[], bool],
                      h_star: torch.Tensor | None = None) -> None:
        dev = self.device
        idx = torch.tensor(rows, dtype=torch.long, device=dev)
        tstar = torch.tensor([ts[r] for r in rows], dtype=torch.long, device=dev)
        # Row r's prefix z_<t* is the first kept + t* − 1 cache slots; crop to the longest
        # prefix needed and mask the rest per row.
        longest = int(tstar.max()) - 1
        masks = []
        for cache, kept in ((pc, p_kept), (qc, q_kept)):
            if len(set(_lengths(cache))) != 1:
                raise PolicyError("residual mode needs a press that keeps the same number of tokens per layer")
            cache.batch_select_indices(idx)
            cache.crop(kept + longest)
            slots = torch.arange(kept + longest, device=dev)
            masks.append((slots[None] < (kept + tstar - 1)[:, None]).long())
        pmask, qmask = masks
        with self._masked_attention():
            # each branch's history: prompt + z_<t* + its own first token
            hp = hq = None
            if h_star is not None:
                hp, hq = History(h_star[idx]).add(x0[idx]), History(h_star[idx]).add(y0[idx])
            self._branch_loop(job, pc, qc, rows, K, tstar, pmask, qmask, x0[idx], y0[idx], rec, gen, cancelled,
                              hp, hq)

    @contextmanager
    def _masked_attention(self) -> Iterator[None]:
        """On CPU, torch's SDPA with a real (non-trivial) mask leaves its fast kernel and
        was ~2.5x slower per decoding step than with no mask; eager attention with the
        same mask was ~1.5-2x faster than that (SmolLM2, 8 rows, 570 slots). GPUs keep SDPA."""
        config = self.model.config
        before = getattr(config, "_attn_implementation", None)
        if self.device.type != "cpu" or before != "sdpa":
            yield
            return
        self.model.set_attn_implementation("eager")
        try:
            yield
        finally:
            self.model.set_attn_implementation(before)

    def _branch_loop(self, job: TraceJob, pc: DynamicCache, qc: DynamicCache, rows: list[int], K: list[int],
                     tstar: torch.Tensor, pmask: torch.Tensor, qmask: torch.Tensor, x: torch.Tensor,
                     y: torch.Tensor, rec: dict, gen: torch.Generator, cancelled: Callable[[], bool],
                     hp: History | None = None, hq: History | None = None) -> None:
        dev, L, eos = self.device, len(job.prompt_ids), self.lm.eos_token_id
        x_done = (x == eos) if eos is not None else torch.zeros_like(x, dtype=torch.bool)
        y_done = (y == eos) if eos is not None else torch.zeros_like(x_done)
        k = 0
        while rows:
            k += 1
            self._check(cancelled)
            ones = torch.ones(len(rows), 1, dtype=torch.long, device=dev)
            pmask, qmask = torch.cat([pmask, ones], 1), torch.cat([qmask, ones], 1)
            pos = L + tstar + k - 2
            p = absorb_eos(probs(self.step(pc, x, pos, pmask), job.sampling, hp), x_done, eos)
            q = absorb_eos(probs(self.step(qc, y, pos, qmask), job.sampling, hq), y_done, eos)
            d = maximal_coupling(p, q, gen)
            if hp is not None:
                hp, hq = hp.add(d.x), hq.add(d.y)
            for r, dv, xv, yv in zip(rows, d.tv.tolist(), d.x.tolist(), d.y.tolist()):
                rec[r][0].append(dv)
                rec[r][1].append(xv)
                rec[r][2].append(yv)
            x, y = d.x, d.y
            if eos is not None:
                x_done |= x == eos
                y_done |= y == eos
            # Drop rows whose branch reached K = min(W, T − t*): the batch shrinks as
            # branches end instead of carrying finished rows to the longest one.
            live = [i for i, r in enumerate(rows) if K[r] > k]
            if len(live) < len(rows):
                sel = torch.tensor(live, dtype=torch.long, device=dev)
                rows = [rows[i] for i in live]
                if rows:
                    pc.batch_select_indices(sel)
                    qc.batch_select_indices(sel)
                    pmask, qmask, tstar = pmask[sel], qmask[sel], tstar[sel]
                    x, y, x_done, y_done = x[sel], y[sel], x_done[sel], y_done[sel]
                    if hp is not None:
                        hp, hq = hp.select(sel), hq.select(sel)

    # ------------------------------------------------------------------ TGI generate

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], policy_id: str, max_new_tokens: int, sampling: Sampling,
                 seed: int | None, top_n: int = 0, stop_check: Callable[[list[int]], bool] | None = None,
                 cancelled: Callable[[], bool] = lambda: False) -> Iterator[dict[str, Any]]:
        """Plain sampling from one policy's kernel (TGI's /generate): yields one dict per
        token with id, logprob (the model's, as TGI reports it) and top tokens, and
        finally a dict with the finish reason."""
        policy = self.registry.resolve(policy_id)
        pre = self.prefill(policy, prompt_ids)
        gen = self.generator(seed if seed is not None else int(torch.randint(0, 2**31 - 1, ()).item()))
        logits, cache, L = pre.logits, pre.cache, len(prompt_ids)
        out: list[int] = []
        eos = self.lm.eos_token_id
        history = self._history(sampling, prompt_ids, 1, logits.shape[-1])
        for t in range(1, max_new_tokens + 1):
            self._check(cancelled)
            p = probs(logits, sampling, history)
            tok = p.argmax(-1) if sampling.greedy else torch.multinomial(p, 1, generator=gen).squeeze(-1)
            tid = int(tok)
            if history is not None:
                history = history.add(tok.reshape(1))
            lp = torch.log_softmax(logits, -1)  # TGI reports the model's log-probability
            item = {"id": tid, "logprob": float(lp[0, tid]), "top": []}
            if top_n:
                vals, ids = lp[0].topk(top_n)
                item["top"] = list(zip(ids.tolist(), vals.tolist()))
            out.append(tid)
            yield item
            if eos is not None and tid == eos:
                yield {"finish_reason": "eos_token"}
                return
            if stop_check is not None and stop_check(out):
                yield {"finish_reason": "stop_sequence"}
                return
            if t < max_new_tokens:
                logits = self.step(cache, tok, torch.tensor([L + t - 1], device=self.device))
        yield {"finish_reason": "length"}

    @torch.inference_mode()
    def prompt_logprobs(self, prompt_ids: list[int]) -> list[float | None]:
        """Log-probabilities of each prompt token under the full model (TGI prefill details)."""
        ids = torch.tensor([prompt_ids], device=self.device)
        logits = self.model(input_ids=ids).logits[0].float().log_softmax(-1)
        lps: list[float | None] = [None]
        lps += logits[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()
        return lps
