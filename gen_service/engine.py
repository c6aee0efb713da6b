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

   When that shortcut does not hold — a press that compresses while decoding, or
   caches whose layers keep different numbers of tokens — the branches are *replayed*
   instead: both sides restart from a snapshot of their state right after prefill,
   every branch row re-feeds its own shared history z_<t* and then its branch tokens,
   all rows in lockstep, so a decoding press compresses each row at exactly the steps
   it did on the survival path and each branch continues from Q's true state at t*.
   The price is up to T − 1 more forwards per side (docs/service.md measures it).

The decoding loops never run a forward themselves: they yield the :class:`Forward`
list a step needs (P's and Q's) and receive the logits back. A driver decides how
those run: alone (one candidate, ``fuse`` off), P's and Q's as one forward where the
measurement says it is faster (``fuse``), or, in a request with several candidates
(:meth:`Engine.trace_candidates`), stacked with the other candidates' forwards in
one batch (:class:`gen_service.shared_cache.StackedPromptCache`), each candidate's
loop keeping its own generator and random numbers.

Each side (P, Q) is a :class:`Side`: its cache plus what its policy applies to its
own forwards only — per-head masks of head-wise presses (AdaKV & co.) and the hooks of
a decoding-time press — installed around that side's forward and removed after, so
nothing leaks into the other model's forwards through the shared modules.
"""

from __future__ import annotations

import copy
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers import DynamicCache

from gen_service.coupling import History, Sampling, absorb_eos, maximal_coupling, probs
from gen_service.errors import ServiceError
from gen_service.head_masks import HIDDEN_ATTR, indices_to_mask, install, pad
from gen_service.models import LoadedModel
from gen_service.presses import ModelInfo, Plan, Policy, PolicyRegistry, iter_presses
from gen_service.quantized import is_quantized
from gen_service.shared_cache import StackedPromptCache, attention_route, share_prompt, stackable
from protocols import Kind

__all__ = ["CandidateDone", "CandidateError", "CandidateFailed", "Cancelled", "Engine", "Forward", "Prefilled",
           "Side", "TraceJob", "PRODUCER"]

PRODUCER = "kvdiv.gen_service"
log = logging.getLogger("kvdiv.service")


class Cancelled(ServiceError):
    """The client went away; work stops between steps."""


class CandidateError(ServiceError):
    """A candidate of a multi-candidate request failed before anything was streamed.

    Attributes
    ----------
    index : int
        Its position in ``candidates``.
    policy : str
        Its policy id.
    cause : BaseException
        What its prefill raised.
    """

    def __init__(self, index: int, policy: str, cause: BaseException):
        super().__init__(f"candidates[{index}] ({policy}): {type(cause).__name__}: {cause}")
        self.index, self.policy, self.cause = index, policy, cause


@dataclass(frozen=True)
class CandidateDone:
    """Yielded by :meth:`Engine.trace` (multi-candidate) when a candidate's records are all out."""

    policy: str


@dataclass(frozen=True)
class CandidateFailed:
    """Yielded by :meth:`Engine.trace` (multi-candidate) when one candidate fails while decoding;
    the other candidates go on."""

    policy: str
    error: BaseException


@dataclass
class TraceJob:
    """A validated ``/v1/traces`` request."""

    prompt_ids: list[int]                 # the context: the part a press compresses
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
    question_ids: list[int] = field(default_factory=list)   # prefilled after compression, never compressed
    # several candidates in one request (records tagged with ``candidate``); ``seeds`` parallel,
    # None where the server draws one; ``candidate`` is then unused
    candidates: list[str] = field(default_factory=list)
    seeds: list[int | None] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        """Positions taken by the prompt (context + question)."""
        return len(self.prompt_ids) + len(self.question_ids)


@dataclass
class Side:
    """One model's decoding state: its cache and what its policy applies to its forwards.

    ``masks[l]`` (rows, kv_heads, slots) marks keys hidden from layer l's attention
    (head-wise presses); ``press`` is a press whose hooks run during this side's
    decoding forwards; ``next_pos`` is the position of the next token fed.
    """

    cache: DynamicCache
    next_pos: int
    masks: list[torch.Tensor | None] | None = None
    press: Any | None = None

    def rows(self, n: int) -> None:
        """Batch 1 -> n identical rows (cache, masks and the decoding press's buffers)."""
        self.cache.batch_repeat_interleave(n)
        if self.masks:
            self.masks = [None if m is None else m.repeat(n, 1, 1) for m in self.masks]
        for press in iter_presses(self.press) if self.press is not None else ():
            # per-layer buffers kvpress keeps across decoding steps, batch first
            for name in ("hidden_states_buffer", "scores_buffer"):
                buffers = getattr(press, name, None)
                for layer, buf in (buffers or {}).items():
                    buffers[layer] = ([t.repeat_interleave(n, 0) for t in buf] if isinstance(buf, list)
                                      else buf.repeat_interleave(n, 0))

    def select(self, idx: torch.Tensor) -> None:
        self.cache.batch_select_indices(idx)
        if self.masks:
            self.masks = [None if m is None else m[idx] for m in self.masks]

    def crop(self, lengths: list[int]) -> None:
        for layer, n in zip(self.cache.layers, lengths, strict=True):
            layer.crop(n)
        if self.masks:
            self.masks = [None if m is None else m[..., :n] for m, n in zip(self.masks, lengths, strict=True)]

    def snapshot(self) -> Side:
        """An independent copy (cache, masks and press state)."""
        return Side(copy.deepcopy(self.cache), self.next_pos,
                    None if self.masks is None else [None if m is None else m.clone() for m in self.masks],
                    copy.deepcopy(self.press))

    def kept(self) -> int:
        """Prompt slots visible on average over layers and heads (masked keys excluded)."""
        total = 0.0
        for i, n in enumerate(_lengths(self.cache)):
            m = self.masks[i] if self.masks else None
            total += n - (0.0 if m is None else float(m[0].sum()) / m.shape[1])
        return int(round(total / max(len(self.cache.layers), 1)))


@dataclass
class Forward:
    """One decoding forward a decoding loop asks for: ``side`` over (rows,) ``tokens`` at
    (rows,) ``positions``, with an optional (rows, slots) ``mask``; ``eager`` asks for
    eager attention with the mask on CPU (the residual prefix branches). The loops yield
    a list of these (P's and Q's) and receive each one's (rows, V) logits back, so that
    the driver decides how the forwards run: one by one, or stacked with other
    candidates' (:meth:`Engine.trace`)."""

    side: Side
    tokens: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor | None = None
    eager: bool = False


@dataclass
class Prefilled:
    """One policy's prompt state (batch 1) and the step-1 logits."""

    side: Side
    logits: torch.Tensor   # (1, V)
    kept: int              # prompt slots in the cache after compression (mean over layers)
    plan: Plan
    kept_slots: list[int] = field(default_factory=list)  # cache slots per layer before decoding

    @property
    def cache(self) -> DynamicCache:
        return self.side.cache


def _lengths(cache: DynamicCache) -> list[int]:
    return [layer.get_seq_length() for layer in cache.layers]


class Engine:
    """Runs prefill and decoding for one loaded model. Not thread-safe: the app runs
    all model work on one worker thread."""

    def __init__(self, lm: LoadedModel, registry: PolicyRegistry | None = None, shared_prompt: bool = True):
        install()  # head-wise masks through SDPA's own mask (gen_service.head_masks)
        self.lm = lm
        self.model = lm.model
        self.registry = registry or PolicyRegistry()
        self.device = lm.device
        # store the prompt once for all rows where the side allows (gen_service/shared_cache.py)
        self.shared_prompt = shared_prompt
        # replay residual branches even when they could be prefixes of the survival
        # caches (benchmarks measure the replay's price with it)
        self.force_replay = False
        # stack the forwards of a multi-candidate request's candidates, and P's with Q's
        # where ``fuse`` says so (False: every forward alone, bit-identical to one request
        # per candidate)
        self.batch_candidates = True
        # P's and Q's stacked forwards as one: "auto" (measured per shape), "on" or "off"
        self.fuse = "auto"
        self.fusion: dict[tuple[int, int, int], dict[str, Any]] = {}

    # ------------------------------------------------------------------ basics

    def generator(self, seed: int) -> torch.Generator:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(int(seed))
        return gen

    def _layers(self) -> list[torch.nn.Module]:
        return [layer.self_attn for layer in self.model.model.layers]

    @torch.inference_mode()
    def prefill(self, policy: Policy, prompt_ids: list[int], question_ids: list[int] = ()) -> Prefilled:
        """Prefill under the policy's press: the forward attends to the whole prompt and
        each layer's cache is compressed right after that layer, so the returned
        logits are the full model's whatever the press. A question is prefilled after
        compression, as kvpress's pipeline does, and is never compressed."""
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        plan = policy.plan(len(prompt_ids))
        cache = DynamicCache() if plan.quant is None else plan.quant.cache(self.model.config.num_hidden_layers)
        positions = torch.arange(len(prompt_ids), device=self.device)[None]
        press = plan.press  # a decoding-only press's hooks do nothing during prefill
        with self._prefill_attention(press), (press(self.model) if press is not None else nullcontext()):
            out = self.model(input_ids=ids, past_key_values=cache, position_ids=positions, logits_to_keep=1)
        return self._finish(plan, cache, out.logits[:, -1].float(), len(prompt_ids), question_ids)

    def _finish(self, plan: Plan, cache: DynamicCache, logits: torch.Tensor, context_len: int,
                question_ids: list[int]) -> Prefilled:
        side = Side(cache, context_len, masks=self._take_masks(cache), press=plan.press if plan.decoding else None)
        if plan.rerotates:  # kept keys were re-rotated to 0..kept-1: continue from there (as kvpress does)
            side.next_pos = _lengths(cache)[0]
        kept = side.kept()
        if question_ids:
            logits = self._prefill_question(side, list(question_ids))
        return Prefilled(side, logits, kept, plan, _lengths(cache))

    def _prefill_question(self, side: Side, question_ids: list[int]) -> torch.Tensor:
        """Feed the question after compression. When layers keep different numbers of
        slots (PyramidKV & co.) one causal mask cannot fit them all, so the question goes
        in one token at a time (the same attention, without a mask)."""
        q = torch.tensor([question_ids], dtype=torch.long, device=self.device)
        pos = torch.arange(side.next_pos, side.next_pos + q.shape[1], device=self.device)[None]
        if len(set(_lengths(side.cache))) == 1:
            logits = self.forward(side, q, pos, logits_to_keep=1)
        else:
            for i in range(q.shape[1]):
                logits = self.forward(side, q[:, i:i + 1], pos[:, i:i + 1])
        side.next_pos += q.shape[1]
        return logits

    def _take_masks(self, cache: DynamicCache) -> list[torch.Tensor | None] | None:
        """Move head-wise masks (kvpress's ``masked_key_indices``, left on the shared
        modules for batch 1) into the side that owns them, as boolean (1, heads, slots)."""
        masks: list[torch.Tensor | None] = []
        for attn, layer in zip(self._layers(), cache.layers, strict=True):
            idx = getattr(attn, "masked_key_indices", None)
            attn.masked_key_indices = None
            masks.append(None if idx is None else indices_to_mask(idx, 1, layer.keys.shape[1], layer.keys.shape[-2]))
        return masks if any(m is not None for m in masks) else None

    @contextmanager
    def _prefill_attention(self, press: Any) -> Iterator[None]:
        """Eager attention for presses that score with the attention weights."""
        if not _wants_eager(press):
            yield
            return
        before = self.model.config._attn_implementation
        self.model.set_attn_implementation("eager")
        try:
            yield
        finally:
            self.model.set_attn_implementation(before)

    @torch.inference_mode()
    def prefill_pair(self, ref: Policy, cand: Policy, prompt_ids: list[int],
                     question_ids: list[int] = ()) -> tuple[Prefilled, Prefilled]:
        """P's and Q's prompt states. With a full reference both come from ONE forward:
        compression does not change a layer's output (it runs after the layer has
        attended to the whole prompt), so hooks registered before the press's keep
        each layer's uncompressed keys/values for P while the press compresses Q's."""
        L = len(prompt_ids)
        ref_plan = ref.plan(L)
        # A press scoring with attention weights prefills under eager attention, whose
        # logits differ from SDPA's in the last bits: P then gets its own forward.
        # A quantized candidate's cache holds no full-precision prompt to copy for P.
        cand_plan = cand.plan(L)
        if ref_plan.press is not None or ref_plan.quant is not None or cand_plan.quant is not None \
                or _wants_eager(cand_plan.press):
            return self.prefill(ref, prompt_ids, question_ids), self.prefill(cand, prompt_ids, question_ids)
        full: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def keep(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            layer = kwargs["past_key_values"].layers[module.layer_idx]
            # clone: a press may edit the tensors it is handed
            full[module.layer_idx] = (layer.keys.clone(), layer.values.clone())

        hooks = [attn.register_forward_hook(keep, with_kwargs=True) for attn in self._layers()]
        try:
            # the prompt only: were the question fed while the hooks are on, they would
            # keep Q's compressed cache + question for P
            q0 = self.prefill(cand, prompt_ids)
        finally:
            for hook in hooks:
                hook.remove()
        cache = DynamicCache()
        for idx in sorted(full):
            cache.update(*full[idx], idx)
        p0 = self._finish(ref_plan, cache, q0.logits, L, question_ids)
        if question_ids:  # what prefill(cand, prompt_ids, question_ids) would have done
            q0.logits = self._prefill_question(q0.side, list(question_ids))
            q0.kept_slots = _lengths(q0.cache)
        return p0, q0

    @torch.inference_mode()
    def forward(self, side: Side, tokens: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None, logits_to_keep: int = 0) -> torch.Tensor:
        """One forward of ``side`` over (rows, n) tokens -> (rows, V) float logits of the
        last one, with that side's head masks and decoding hooks in place."""
        with self._side_applied(side, tokens.shape[1]), attention_route(self.model, side.cache, mask) as (mask, kw):
            out = self.model(input_ids=tokens, past_key_values=side.cache, position_ids=positions,
                             attention_mask=mask, use_cache=True, logits_to_keep=logits_to_keep, **kw)
        return out.logits[:, -1].float()

    @contextmanager
    def _side_applied(self, side: Side, n_new: int) -> Iterator[None]:
        """Install ``side``'s head masks and decoding hooks for one forward, then take
        them off the shared modules (with any masks a press added meanwhile)."""
        if side.masks is None and side.press is None:
            yield
            return
        attns = self._layers()
        hooks = []
        if side.masks is not None:
            for attn, m, n in zip(attns, side.masks, _lengths(side.cache), strict=True):
                setattr(attn, HIDDEN_ATTR, None if m is None else pad(m, n + n_new))
        if side.press is not None:
            hooks = [attn.register_forward_hook(side.press.forward_hook, with_kwargs=True) for attn in attns]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
            shape = side.cache.layers[0].keys.shape
            masks = []
            for attn, n in zip(attns, _lengths(side.cache), strict=True):
                m, added = getattr(attn, HIDDEN_ATTR, None), getattr(attn, "masked_key_indices", None)
                setattr(attn, HIDDEN_ATTR, None)
                attn.masked_key_indices = None
                if added is not None:  # e.g. DMS evicting while decoding
                    fresh = indices_to_mask(added, shape[0], shape[1], n)
                    m = fresh if m is None else pad(m, fresh.shape[-1]) | fresh
                masks.append(None if m is None else pad(m, n))
            side.masks = masks if any(m is not None for m in masks) else None

    @torch.inference_mode()
    def step(self, side: Side | DynamicCache, tokens: torch.Tensor, positions: torch.Tensor,
             mask: torch.Tensor | None = None) -> torch.Tensor:
        """One decoding forward over all rows: (rows,) tokens -> (rows, V) float logits."""
        if isinstance(side, DynamicCache):
            side = Side(side, 0)
        return self.forward(side, tokens[:, None], positions[:, None], mask)

    # ------------------------------------------------------------------ traces

    def header(self, job: TraceJob, seed: int, cand: Policy, ref: Policy, p0: Prefilled,
               q0: Prefilled) -> dict[str, Any]:
        from protocols import header_record, prompt_digest

        candidate = cand.describe()
        candidate.update(params=q0.plan.params, note=q0.plan.note)
        reference = ref.describe()
        nq = len(job.question_ids)
        extra = {"question_tokens": nq} if nq else {}
        return header_record(
            kind=job.kind, horizon=job.horizon, window=job.window or job.horizon, model=self.lm.name,
            eos_token_id=self.lm.eos_token_id, sampling=job.sampling.as_dict(), candidate=candidate,
            reference=reference, seed=seed, prompt_tokens=job.prompt_len,
            prompt_sha256=prompt_digest([*job.prompt_ids, *job.question_ids]), retained_tokens=q0.kept + nq,
            replicates=job.replicates, vocab_size=self.lm.vocab_size, doc=job.doc, request_id=job.request_id,
            coupling="stepwise-maximal", producer=PRODUCER, reference_retained_tokens=p0.kept + nq, **extra,
        )

    def trace(self, job: TraceJob, cancelled: Callable[[], bool] = lambda: False) -> Iterator[Any]:
        """Yield the stream's records (header, steps / shared steps + branches); the
        caller adds the ``end`` record (it owns the digest).

        With ``job.candidates`` the request holds several candidates
        (:meth:`trace_candidates`): every header first, then the candidates' records
        interleaved, each tagged with ``candidate``, and a :class:`CandidateDone` or
        :class:`CandidateFailed` per candidate where its ``end`` or ``error`` goes."""
        if job.candidates:
            yield from self.trace_candidates(job, cancelled)
            return
        seed = job.seed if job.seed is not None else _draw_seed()
        info = ModelInfo.of(self.lm)
        cand = self.registry.build(job.candidate, info)
        ref = self.registry.build(job.reference, info)
        p0, q0 = self.prefill_pair(ref, cand, job.prompt_ids, job.question_ids)
        yield self.header(job, seed, cand, ref, p0, q0)
        yield from self._drive(self._decode(job, p0, q0, seed, cancelled))

    def _decode(self, job: TraceJob, p0: Prefilled, q0: Prefilled, seed: int,
                cancelled: Callable[[], bool]) -> Iterator[Any]:
        """One candidate's decoding loop: records, and the :class:`Forward` lists it needs run."""
        if self.shared_prompt:
            for side in (p0.side, q0.side):
                share_prompt(side, job.horizon)
        gen = self.generator(seed)
        if job.kind == Kind.COUPLED:
            return self._coupled(job, p0, q0, gen, cancelled)
        return self._residual(job, p0, q0, gen, cancelled)

    def _drive(self, loop: Iterator[Any]) -> Iterator[dict[str, Any]]:
        """Run one decoding loop on its own: each forward it asks for, one after the other."""
        answer = None
        while True:
            try:
                item = loop.send(answer)
            except StopIteration:
                return
            if isinstance(item, list):
                answer = self._run_forwards({0: item})[0]
            else:
                answer = None
                yield item

    def _run_forward(self, f: Forward) -> torch.Tensor:
        with self._masked_attention() if f.eager else nullcontext():
            return self.step(f.side, f.tokens, f.positions, f.mask)

    # ------------------------------------------------------------------ several candidates

    def trace_candidates(self, job: TraceJob, cancelled: Callable[[], bool] = lambda: False) -> Iterator[Any]:
        """Several candidates against one reference, on one prompt, in one request.

        Each candidate is prefilled exactly as its own request would be
        (:meth:`prefill_pair`: kvpress compresses inside the prefill forward, so every
        candidate needs its forward over the prompt; P's full cache comes out of the
        same forward) and decodes with its own generator seeded with its own seed,
        drawing the same random numbers in the same order as its own request. Only the
        forwards are shared: at every step the candidates' loops each ask for their P
        and Q forwards, and those whose sides take the shared prompt path
        (:func:`gen_service.shared_cache.stackable`) run stacked in one batch, P rows
        with P rows (one forward over the shared uncompressed prompt) and Q rows with
        Q rows, each group attending to its own prompt. Sides that cannot stack (per-head
        masks, decoding-time presses, per-row copies) run their own forwards, exactly as
        alone. Stacking changes only the batch of the row-wise matmuls, whose last bits
        depend on the batch size on CPU, so traces equal one request per candidate to
        floating-point rounding (the tests find the same tokens); ``batch_candidates =
        False`` runs every forward alone and gives bit-identical traces.

        Yields
        ------
        dict or CandidateDone or CandidateFailed
            Every header (candidate order), then the records, each with
            ``"candidate": policy``, and one marker per candidate when it ends.

        Raises
        ------
        CandidateError
            A candidate's policy failed in prefill (nothing was yielded yet).
        Cancelled
            The client went away (or the request ran out of time).
        """
        info = ModelInfo.of(self.lm)
        ref = self.registry.build(job.reference, info)
        runs, headers = [], []
        for i, (policy, seed) in enumerate(zip(job.candidates, job.seeds or [None] * len(job.candidates),
                                               strict=True)):
            self._check(cancelled)
            try:
                cand = self.registry.build(policy, info)
                p0, q0 = self.prefill_pair(ref, cand, job.prompt_ids, job.question_ids)
            except Cancelled:
                raise
            except Exception as exc:
                raise CandidateError(i, policy, exc) from exc
            seed = seed if seed is not None else _draw_seed()
            one = replace(job, candidate=policy, seed=seed, candidates=[], seeds=[])
            runs.append((one, seed, p0, q0))
            headers.append(self.header(one, seed, cand, ref, p0, q0))
        yield from headers   # only once every prefill ran: a policy failing there is a 422
        loops = [self._decode(one, p0, q0, seed, cancelled) for one, seed, p0, q0 in runs]
        yield from self._drive_many(job.candidates, loops)

    def _drive_many(self, policies: list[str], loops: list[Iterator[Any]]) -> Iterator[Any]:
        """Advance every candidate's loop to its next forwards, run them together, repeat."""
        answers: list[Any] = [None] * len(loops)
        live = list(range(len(loops)))
        while live:
            asks: dict[int, list[Forward]] = {}
            for i in list(live):
                try:
                    while True:
                        item = loops[i].send(answers[i])
                        answers[i] = None
                        if isinstance(item, list):
                            asks[i] = item
                            break
                        item["candidate"] = policies[i]
                        yield item
                except StopIteration:
                    live.remove(i)
                    yield CandidateDone(policies[i])
                except Cancelled:
                    raise
                except Exception as exc:  # this candidate's own work failed: the others go on
                    log.error("candidate %s failed while decoding", policies[i], exc_info=exc)
                    live.remove(i)
                    yield CandidateFailed(policies[i], exc)
            if asks:
                answers_now = self._run_forwards(asks)
                for i, logits in answers_now.items():
                    answers[i] = logits

    def _run_forwards(self, asks: dict[int, list[Forward]]) -> dict[int, list[torch.Tensor]]:
        """The forwards every candidate asked for this round, stacked where their sides allow."""
        out = {i: [None] * len(fs) for i, fs in asks.items()}
        stack: dict[int, list[tuple[int, int, Forward]]] = {}
        for i, fs in asks.items():
            for j, f in enumerate(fs):
                if self.batch_candidates and stackable(f.side):
                    stack.setdefault(j, []).append((i, j, f))   # j: 0 = P's forward, 1 = Q's
                else:
                    out[i][j] = self._run_forward(f)
        groups = list(stack.values())
        if len(groups) == 2 and self._fused(groups):
            groups = [groups[0] + groups[1]]
        for group in groups:
            for (i, j, _), logits in zip(group, self._run_group([f for _, _, f in group]), strict=True):
                out[i][j] = logits
        return out

    def _run_group(self, forwards: list[Forward]) -> list[torch.Tensor]:
        """Stacked forwards in one batch; a group of one runs as its own forward."""
        if len(forwards) == 1:
            return [self._run_forward(forwards[0])]
        return self._forward_stacked(forwards)

    # ------------------------------------------------------------------ fused P + Q

    def _fused(self, groups: list[list[tuple[int, int, Forward]]]) -> bool:
        """Whether P's and Q's stacked forwards run as one forward: ``fuse`` "on"/"off", or
        "auto": measured on the first step of each shape (:meth:`_measure_fusion`), then kept."""
        if self.fuse != "auto":
            return self.fuse == "on"
        forwards = [f for group in groups for _, _, f in group]
        rows = sum(f.tokens.shape[0] for f in forwards)
        prompt = max(f.side.cache.layers[0].prompt_keys.shape[-2] for f in forwards)
        key = (_bucket(rows), len(forwards), _bucket(prompt))
        if key not in self.fusion:
            self.fusion[key] = self._measure_fusion(groups, key)
        return self.fusion[key]["fused"]

    def _measure_fusion(self, groups: list[list[tuple[int, int, Forward]]], key: tuple[int, int, int]
                        ) -> dict[str, Any]:
        """Time this decoding step both ways — P's and Q's forwards apart, and one forward
        over both — three times alternately, on the live caches: a forward only writes
        the rows' new slot and advances ``filled``, so putting ``filled`` back undoes it
        (the real step then writes the same slot). Keeps the faster (best of three)."""
        parts = [[f for _, _, f in group] for group in groups]
        layers = [layer for part in parts for f in part for layer in f.side.cache.layers]
        filled = [layer.filled for layer in layers]
        times: dict[str, list[float]] = {"separate": [], "fused": []}
        for _ in range(3):
            for mode in times:
                t0 = self._clock()
                if mode == "separate":
                    for part in parts:
                        self._run_group(part)
                else:
                    self._forward_stacked(parts[0] + parts[1])
                times[mode].append(self._clock() - t0)
                for layer, n in zip(layers, filled, strict=True):
                    layer.filled = n
        sep, fused = min(times["separate"]), min(times["fused"])
        log.info("fused P+Q forward for rows<=%d, %d forwards, prompt<=%d: %.1f ms vs %.1f ms apart", *key,
                 fused * 1e3, sep * 1e3)
        return {"rows": key[0], "forwards": key[1], "prompt_tokens": key[2], "separate_ms": round(sep * 1e3, 2),
                "fused_ms": round(fused * 1e3, 2), "fused": fused < sep}

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def fusion_info(self) -> dict[str, Any]:
        """The fused-forward setting and every shape's measurement so far (``/info``)."""
        return {"mode": self.fuse, "measured": list(self.fusion.values())}

    @torch.inference_mode()
    def _forward_stacked(self, forwards: list[Forward]) -> list[torch.Tensor]:
        """One forward over several shared-prompt sides' rows (:class:`StackedPromptCache`)."""
        stack = StackedPromptCache([f.side.cache for f in forwards], [f.mask for f in forwards])
        tokens = torch.cat([f.tokens for f in forwards])[:, None]
        positions = torch.cat([f.positions for f in forwards])[:, None]
        with attention_route(self.model, stack, None) as (_, kw):
            out = self.model(input_ids=tokens, past_key_values=stack, position_ids=positions, use_cache=True,
                             logits_to_keep=0, **kw)
        return list(out.logits[:, -1].float().split([f.tokens.shape[0] for f in forwards]))

    def _history(self, sampling: Sampling, prompt_ids: list[int], rows: int, vocab: int) -> History | None:
        """Each side's token counts for the history penalties; None (free) when none is set."""
        if not sampling.uses_history:
            return None
        return History.start(prompt_ids, rows, vocab, self.device)

    def _check(self, cancelled: Callable[[], bool]) -> None:
        if cancelled():
            raise Cancelled()

    def _pos(self, side: Side, rows: int, t: int) -> torch.Tensor:
        """Positions of the step-t input (the token drawn at step t) for every row."""
        return torch.full((rows,), side.next_pos + t - 1, dtype=torch.long, device=self.device)

    def _coupled(self, job: TraceJob, p0: Prefilled, q0: Prefilled, gen: torch.Generator,
                 cancelled: Callable[[], bool]) -> Iterator[dict[str, Any]]:
        from protocols import step_record

        R, T = job.replicates, job.horizon
        eos = self.lm.eos_token_id
        ps, qs = p0.side, q0.side
        ps.rows(R)
        qs.rows(R)
        lp, lq = p0.logits.expand(R, -1), q0.logits.expand(R, -1)
        x_done = torch.zeros(R, dtype=torch.bool, device=self.device)
        y_done = torch.zeros_like(x_done)
        # P and Q are penalised by their own histories (prompt + x_<t, prompt + y_<t)
        hp = hq = self._history(job.sampling, job.prompt_ids + job.question_ids, R, lp.shape[-1])
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
                lp, lq = yield [Forward(ps, d.x, self._pos(ps, R, t)), Forward(qs, d.y, self._pos(qs, R, t))]

    def _residual(self, job: TraceJob, p0: Prefilled, q0: Prefilled, gen: torch.Generator,
                  cancelled: Callable[[], bool]) -> Iterator[dict[str, Any]]:
        from protocols import shared_step_record

        R, T = job.replicates, job.horizon
        W = job.window or T
        eos = self.lm.eos_token_id
        dev = self.device
        replay = self.force_replay or _needs_replay(p0, q0)
        start = (p0.side.snapshot(), q0.side.snapshot()) if replay else None
        ps, qs = p0.side, q0.side
        ps.rows(R)
        qs.rows(R)
        lp, lq = p0.logits.expand(R, -1), q0.logits.expand(R, -1)
        z_done = torch.zeros(R, dtype=torch.bool, device=dev)
        alive = torch.ones(R, dtype=torch.bool, device=dev)       # survival path not stopped
        surv = torch.ones(R, dtype=torch.float64, device=dev)     # S_{t-1}
        mass = torch.zeros(R, dtype=torch.float64, device=dev)    # Σ_{s≤t} π_s
        t_star = torch.zeros(R, dtype=torch.long, device=dev)
        x0 = torch.zeros(R, dtype=torch.long, device=dev)
        y0 = torch.zeros(R, dtype=torch.long, device=dev)
        tv_star = torch.zeros(R, dtype=torch.float64, device=dev)
        shared: list[torch.Tensor] = []                          # z_t, kept for replayed branches
        # history penalties: both sides share prompt + z_<t; each row keeps its counts
        # at t* so its two branches continue from their own histories
        h0 = hz = self._history(job.sampling, job.prompt_ids + job.question_ids, R, lp.shape[-1])
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
                t, [v if a else None for v, a in zip(d.tv.tolist(), shown, strict=True)],
                [v if a else None for v, a in zip(d.overlap.tolist(), has_token, strict=True)])
            surv = torch.where(alive, surv * (1.0 - delta), surv)
            alive &= ~d.stop
            if eos is not None:
                z_done |= d.overlap == eos
            shared.append(d.overlap)
            if t < T:
                lp, lq = yield [Forward(ps, d.overlap, self._pos(ps, R, t)),
                                Forward(qs, d.overlap, self._pos(qs, R, t))]
        branch = _Branches(t_star, x0, y0, tv_star, W, T)
        if branch.rows and start is not None:
            yield from self._replay_branches(job, start, torch.stack(shared, 1), branch, gen, cancelled, h0)
        elif branch.rows:
            yield from self._run_branches(job, ps, qs, p0.kept_slots, q0.kept_slots, branch, gen, cancelled, h_star)
        yield from branch.records()

    def _run_branches(self, job: TraceJob, ps: Side, qs: Side, p_kept: list[int], q_kept: list[int],
                      br: _Branches, gen: torch.Generator, cancelled: Callable[[], bool],
                      h_star: torch.Tensor | None = None) -> Iterator[list[Forward]]:
        """Branches as prefixes of the survival caches (uniform, prefill-only presses).
        ``h_star`` holds each row's history counts at its branch point (prompt + z_<t*)."""
        dev = self.device
        rows = br.rows
        idx = torch.tensor(rows, dtype=torch.long, device=dev)
        tstar = torch.tensor([br.ts[r] for r in rows], dtype=torch.long, device=dev)
        # Row r's prefix z_<t* is the first kept + t* − 1 cache slots; crop to the longest
        # prefix needed and mask the rest per row.
        longest = int(tstar.max()) - 1
        masks = []
        for side, kept in ((ps, p_kept[0]), (qs, q_kept[0])):
            side.select(idx)
            side.crop([kept + longest] * len(side.cache.layers))
            slots = torch.arange(kept + longest, device=dev)
            masks.append((slots[None] < (kept + tstar - 1)[:, None]).long())
        pmask, qmask = masks
        # each branch's history: prompt + z_<t* + its own first token
        hp = hq = None
        if h_star is not None:
            hp, hq = History(h_star[idx]).add(br.x0[idx]), History(h_star[idx]).add(br.y0[idx])
        # head masks ride on kvpress's patched SDPA; eager attention would drop them
        eager = not (ps.masks or qs.masks)
        yield from self._branch_loop(job, ps, qs, rows, br, tstar, pmask, qmask, br.x0[idx], br.y0[idx], gen,
                                     cancelled, hp, hq, eager)

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

    def _branch_loop(self, job: TraceJob, ps: Side, qs: Side, rows: list[int], br: _Branches,
                     tstar: torch.Tensor, pmask: torch.Tensor, qmask: torch.Tensor, x: torch.Tensor,
                     y: torch.Tensor, gen: torch.Generator, cancelled: Callable[[], bool],
                     hp: History | None = None, hq: History | None = None,
                     eager: bool = False) -> Iterator[list[Forward]]:
        dev, eos = self.device, self.lm.eos_token_id
        x_done = (x == eos) if eos is not None else torch.zeros_like(x, dtype=torch.bool)
        y_done = (y == eos) if eos is not None else torch.zeros_like(x_done)
        k = 0
        while rows:
            k += 1
            self._check(cancelled)
            ones = torch.ones(len(rows), 1, dtype=torch.long, device=dev)
            pmask, qmask = torch.cat([pmask, ones], 1), torch.cat([qmask, ones], 1)
            lp, lq = yield [Forward(ps, x, ps.next_pos + tstar + k - 2, pmask, eager),
                            Forward(qs, y, qs.next_pos + tstar + k - 2, qmask, eager)]
            d = maximal_coupling(absorb_eos(probs(lp, job.sampling, hp), x_done, eos),
                                 absorb_eos(probs(lq, job.sampling, hq), y_done, eos), gen)
            if hp is not None:
                hp, hq = hp.add(d.x), hq.add(d.y)
            br.add(rows, d)
            x, y = d.x, d.y
            if eos is not None:
                x_done |= x == eos
                y_done |= y == eos
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
                    x, y, x_done, y_done = x[sel], y[sel], x_done[sel], y_done[sel]
                    if hp is not None:
                        hp, hq = hp.select(sel), hq.select(sel)

    def _replay_branches(self, job: TraceJob, start: tuple[Side, Side], shared: torch.Tensor, br: _Branches,
                         gen: torch.Generator, cancelled: Callable[[], bool],
                         h0: History | None = None) -> Iterator[list[Forward]]:
        """Branches replayed from the post-prefill state: row r feeds z_1..z_{t*-1}, then its
        residual pair (X, Y) at step t*, then its own branch draws, all rows in lockstep.
        A decoding-time press thus compresses each row at the steps it did on the survival
        path, and each branch continues from Q's true state at t*. ``h0`` (the prompt's
        counts per replicate) starts each side's penalty history, which then grows by
        exactly the tokens that side is fed: prompt + z_<t* + its own branch, as on the
        non-replayed path."""
        dev, eos = self.device, self.lm.eos_token_id
        rows = br.rows
        idx = torch.tensor(rows, dtype=torch.long, device=dev)
        ts = torch.tensor([br.ts[r] for r in rows], dtype=torch.long, device=dev)
        last = torch.tensor([br.ts[r] + br.K[r] - 1 for r in rows], dtype=torch.long, device=dev)
        z = shared[idx]                                           # (B, T)
        ps, qs = start
        ps.rows(len(rows))
        qs.rows(len(rows))
        x, y = br.x0[idx], br.y0[idx]
        x_done = (x == eos) if eos is not None else torch.zeros_like(x, dtype=torch.bool)
        y_done = (y == eos) if eos is not None else torch.zeros_like(x_done)
        hp = hq = None if h0 is None else h0.select(idx)
        for s in range(1, int(last.max()) + 1):
            self._check(cancelled)
            before, at = s < ts, s == ts
            xin = torch.where(before, z[:, s - 1], torch.where(at, br.x0[idx], x))
            yin = torch.where(before, z[:, s - 1], torch.where(at, br.y0[idx], y))
            n = len(rows)
            lp, lq = yield [Forward(ps, xin, self._pos(ps, n, s)), Forward(qs, yin, self._pos(qs, n, s))]
            if hp is not None:
                hp, hq = hp.add(xin), hq.add(yin)
            d = maximal_coupling(absorb_eos(probs(lp, job.sampling, hp), x_done, eos),
                                 absorb_eos(probs(lq, job.sampling, hq), y_done, eos), gen)
            active = ((s >= ts) & (s <= last)).tolist()
            br.add([r for r, a in zip(rows, active, strict=True) if a], d, [i for i, a in enumerate(active) if a])
            on = (s >= ts)
            x, y = torch.where(on, d.x, x), torch.where(on, d.y, y)
            if eos is not None:
                x_done |= on & (x == eos)
                y_done |= on & (y == eos)

    # ------------------------------------------------------------------ TGI generate

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], policy_id: str, max_new_tokens: int, sampling: Sampling,
                 seed: int | None, top_n: int = 0, stop_check: Callable[[list[int]], bool] | None = None,
                 cancelled: Callable[[], bool] = lambda: False) -> Iterator[dict[str, Any]]:
        """Plain sampling from one policy's kernel (TGI's /generate): yields one dict per
        token with id, logprob (the model's, as TGI reports it) and top tokens, and
        finally a dict with the finish reason."""
        policy = self.registry.build(policy_id, ModelInfo.of(self.lm))
        pre = self.prefill(policy, prompt_ids)
        gen = self.generator(seed if seed is not None else int(torch.randint(0, 2**31 - 1, ()).item()))
        logits, side = pre.logits, pre.side
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
                item["top"] = list(zip(ids.tolist(), vals.tolist(), strict=True))
            out.append(tid)
            yield item
            if eos is not None and tid == eos:
                yield {"finish_reason": "eos_token"}
                return
            if stop_check is not None and stop_check(out):
                yield {"finish_reason": "stop_sequence"}
                return
            if t < max_new_tokens:
                logits = self.step(side, tok, self._pos(side, 1, t))
        yield {"finish_reason": "length"}

    @torch.inference_mode()
    def prompt_logprobs(self, prompt_ids: list[int]) -> list[float | None]:
        """Log-probabilities of each prompt token under the full model (TGI prefill details)."""
        ids = torch.tensor([prompt_ids], device=self.device)
        logits = self.model(input_ids=ids).logits[0].float().log_softmax(-1)
        lps: list[float | None] = [None]
        lps += logits[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()
        return lps


def _bucket(n: int) -> int:
    """The next power of two (shapes measured once per bucket)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def _draw_seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()).item())


def _wants_eager(press: Any) -> bool:
    """Presses that score with the attention weights (only eager attention returns them)."""
    from kvpress import KVComposePress, ObservedAttentionPress

    scorers = (ObservedAttentionPress, KVComposePress)
    return press is not None and any(isinstance(p, scorers) for p in iter_presses(press))


class _Branches:
    """Branch points, residual pairs and the records being filled, per replicate."""

    def __init__(self, t_star: torch.Tensor, x0: torch.Tensor, y0: torch.Tensor, tv_star: torch.Tensor,
                 W: int, T: int):
        self.ts = t_star.tolist()
        self.x0, self.y0 = x0, y0
        self.K = [min(W, T - t) if t > 0 else 0 for t in self.ts]
        self.rec = {r: ([tv], [x], [y]) for r, (t, tv, x, y) in
                    enumerate(zip(self.ts, tv_star.tolist(), x0.tolist(), y0.tolist(), strict=True)) if t > 0}
        self.rows = [r for r in self.rec if self.K[r] > 0]

    def add(self, rows: list[int], d: Any, at: list[int] | None = None) -> None:
        """Append one age's draws for ``rows`` (positions ``at`` of the batch, default all)."""
        tv, xs, ys = d.tv.tolist(), d.x.tolist(), d.y.tolist()
        for r, i in zip(rows, at if at is not None else range(len(rows)), strict=True):
            self.rec[r][0].append(tv[i])
            self.rec[r][1].append(xs[i])
            self.rec[r][2].append(ys[i])

    def records(self) -> Iterator[dict[str, Any]]:
        from protocols import branch_record

        for r in sorted(self.rec):
            tvs, xs, ys = self.rec[r]
            yield branch_record(r, self.ts[r], tvs, xs, ys)


def _needs_replay(p0: Prefilled, q0: Prefilled) -> bool:
    """Branch caches are prefixes of the survival caches only when no press acts while
    decoding, no cache is quantized while decoding, and every layer of each side keeps
    the same number of prompt slots."""
    return any(pre.side.press is not None or is_quantized(pre.cache) or len(set(_lengths(pre.cache))) != 1
               for pre in (p0, q0))
