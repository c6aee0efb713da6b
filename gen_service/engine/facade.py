"""The :class:`Engine`: one loaded model's prefill and decoding, as the service calls it.

A thin facade over the package's functions (prefill, the decoding loops, the
scheduler, TGI generate): it holds the model, the policy registry and the settings the
operator and the benchmarks change on a live engine (``shared_prompt``, ``shared_prefill``,
``force_replay``, ``batch_candidates``, ``fuse``, ``readback_every``). Its underscored methods are the
seams the tests and benchmarks patch or call (``_decode``, ``_run_forward``, ``_forward_stacked``):
the facade routes through them so a patch on an instance takes effect. Choosing the
decoding loop by kind is :mod:`gen_service.engine.loops`; running a loop on its own is
:func:`gen_service.engine.scheduler.drive` with :meth:`Engine.runner`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch
from transformers import DynamicCache

from gen_service.attention.head_masks import install
from gen_service.attention.plan import attention_plan
from gen_service.attention.shared_cache import share_prompt
from gen_service.engine.coupling import draw_seed, seeded
from gen_service.engine.forwards import masked_attention, run_side, run_stacked
from gen_service.engine.generate import generate, prompt_logprobs
from gen_service.engine.graphs import CudaGraphs
from gen_service.engine.header import header
from gen_service.engine.jobs import Built, Policies, Sampling, TraceJob, check
from gen_service.engine.loops import decode
from gen_service.engine.prefill import prefill, prefill_document, prefill_pair
from gen_service.engine.readback import READBACK_EVERY
from gen_service.engine.scheduler import Runner, run_steps, steps, steps_many
from gen_service.engine.sides import Forward, Prefilled, Side
from gen_service.errors import Cancelled, CandidateError, ConfigError
from gen_service.models.loading import LoadedModel
from gen_service.models.row_padding import pad_linear_rows
from gen_service.presses.registry import ModelInfo, Policy, PolicyRegistry

__all__ = ["Engine"]


class Engine:
    """Runs prefill and decoding for one loaded model. Not thread-safe: the app runs
    all model work on one worker thread."""

    def __init__(self, lm: LoadedModel, registry: PolicyRegistry | None = None, shared_prompt: bool = True):
        install()  # head-wise masks through SDPA's own mask (gen_service.attention.head_masks)
        self.lm = lm
        self.model = lm.model
        # each attention feature's path, decided now (refuses what no path reproduces)
        self.attention = attention_plan(lm.model, lm.name)
        # a request's numbers independent of its batch-mates (:meth:`make_batch_invariant`,
        # by a service that decodes requests together); the linear layers it padded
        self.batch_invariant = False
        self.padded_linears = 0
        self.registry = registry or PolicyRegistry()
        self.device = lm.device
        # store the prompt once for all rows where the side allows (gen_service/attention/shared_cache.py)
        self.shared_prompt = shared_prompt
        # a multi-candidate request prefills P's prompt once for all its candidates
        # (False: one prefill per candidate, the earlier way; benchmarks compare the two)
        self.shared_prefill = True
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
        # decoding steps between the records' host copies (gen_service.engine.readback)
        self.readback_every = READBACK_EVERY
        # stacked forwards captured as CUDA graphs and replayed (use_cuda_graphs; None: off)
        self.cuda_graphs: CudaGraphs | None = None

    # ------------------------------------------------------------------ forwards

    def prefill(self, policy: Policy, prompt_ids: list[int], question_ids: Sequence[int] = ()) -> Prefilled:
        """One policy's prompt state (:func:`gen_service.engine.prefill.prefill`)."""
        return prefill(self.model, policy, prompt_ids, question_ids)

    def prefill_pair(self, ref: Policy, cand: Policy, prompt_ids: list[int],
                     question_ids: Sequence[int] = ()) -> tuple[Prefilled, Prefilled]:
        """P's and Q's prompt states (:func:`gen_service.engine.prefill.prefill_pair`)."""
        return prefill_pair(self.model, ref, cand, prompt_ids, question_ids)

    def prefill_document(self, ref: Policy, cands: Sequence[Policy], prompt_ids: list[int],
                         question_ids: Sequence[int] = ()) -> list[tuple[Prefilled, Prefilled] | Exception]:
        """Every candidate's P and Q prompt states for one document: P's prompt prefilled and
        stored once (:func:`gen_service.engine.prefill.prefill_document`), or, with
        ``shared_prefill`` off, one :meth:`prefill_pair` per candidate as before."""
        if self.shared_prefill:
            return prefill_document(self.model, ref, cands, prompt_ids, question_ids)
        return [_attempt(lambda c=c: self.prefill_pair(ref, c, prompt_ids, question_ids)) for c in cands]

    def forward(self, side: Side, tokens: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None, logits_to_keep: int = 0) -> torch.Tensor:
        """One forward of ``side`` over (rows, n) tokens -> (rows, V) logits of the last one."""
        return run_side(self.model, side, tokens, positions, mask, logits_to_keep)

    def step(self, side: Side | DynamicCache, tokens: torch.Tensor, positions: torch.Tensor,
             mask: torch.Tensor | None = None) -> torch.Tensor:
        """One decoding forward over all rows: (rows,) tokens -> (rows, V) float logits."""
        if isinstance(side, DynamicCache):
            side = Side(side, 0)
        return self.forward(side, tokens[:, None], positions[:, None], mask)

    def _run_forward(self, f: Forward) -> torch.Tensor:
        with masked_attention(self.model, self.device) if f.eager else nullcontext():
            return self.step(f.side, f.tokens, f.positions, f.mask)

    def _forward_stacked(self, fs: list[Forward]) -> list[torch.Tensor]:
        if self.cuda_graphs is not None:
            return self.cuda_graphs.run(fs)
        return run_stacked(self.model, fs)

    def use_cuda_graphs(self, on: bool) -> None:
        """Capture the stacked decoding forwards as CUDA graphs and replay them
        (:mod:`gen_service.engine.graphs`), or stop.

        Raises
        ------
        ConfigError
            When asked on a model that is not on a CUDA device.
        """
        if not on:
            self.cuda_graphs = None
            return
        if self.device.type != "cuda":
            raise ConfigError(f"--cuda-graphs needs a CUDA device; this server runs on {self.device.type}")
        if self.attention.windowed:
            # a window reads the rows' positions, written on the host at each forward: a replayed
            # graph would not write them
            raise ConfigError(f"--cuda-graphs: {self.lm.name} has sliding-window layers "
                              f"{self.attention.windowed}, which the captured graphs do not reproduce")
        self.cuda_graphs = CudaGraphs(self.model)

    def make_batch_invariant(self) -> None:
        """Make each request's records the same bits alone and merged with others: a
        stackable forward alone goes through the stacked path too (as it would merged),
        and on the CPU every decoder linear takes at least 16 rows
        (:mod:`gen_service.models.row_padding`). For a service that decodes requests
        together; it costs time and the pool's copy of a lone prompt (docs/service.md,
        "Batch invariance and the control"). On the CPU only, where both causes were
        measured; on CUDA nothing changes (unmeasured there: no GPU was lent)."""
        if self.device.type != "cpu":
            return
        self.batch_invariant = True
        self.padded_linears = pad_linear_rows(self.model)

    def runner(self) -> Runner:
        """The scheduler's view of this engine's settings, read now."""
        return Runner(lambda f: self._run_forward(f), lambda fs: self._forward_stacked(fs), self.device,
                      self.batch_candidates, self.fuse, self.fusion, self.batch_invariant)

    def fusion_info(self) -> dict[str, Any]:
        """The fused-forward setting and every shape's measurement so far (``/info``)."""
        return {"mode": self.fuse, "measured": list(self.fusion.values())}

    # ------------------------------------------------------------------ traces

    def policies(self, job: TraceJob) -> Policies:
        """The job's policies as the intake built them (gen_service/serving/intake.py), once for
        its prompt. A job made without the intake (tests and benchmarks driving the engine
        directly) has them built here, from its ids, once."""
        if job.policies is None:
            info = ModelInfo.of(self.lm)
            job.policies = Policies(Built(job.reference, self.registry.build(job.reference, info), len(job.prompt_ids)),
                                    tuple(Built(p, self.registry.build(p, info), len(job.prompt_ids))
                                          for p in job.policy_ids))
        return job.policies

    def header(self, job: TraceJob, seed: int, cand: Policy | Built, ref: Policy | Built, p0: Prefilled,
               q0: Prefilled) -> dict[str, Any]:
        return header(self.lm, job, seed, cand, ref, p0, q0, fuse=self.fuse, attention=self.attention.header())

    def trace(self, job: TraceJob, cancelled: Callable[[], bool] = lambda: False) -> Iterator[Any]:
        """Yield the stream's records (header, steps / shared steps + branches /
        reference steps); the caller adds the ``end`` record (it owns the digest).

        With ``job.candidates`` the request holds several candidates
        (:meth:`trace_candidates`): every header first, then the candidates' records
        interleaved, each tagged with ``candidate``, and a :class:`CandidateDone` or
        :class:`CandidateFailed` per candidate where its ``end`` or ``error`` goes."""
        yield from run_steps(self.trace_steps(job, cancelled), self.runner())

    def trace_steps(self, job: TraceJob, cancelled: Callable[[], bool] = lambda: False) -> Iterator[Any]:
        """:meth:`trace`'s items with each decoding step's forwards left to the caller: the
        records, and a :class:`gen_service.engine.scheduler.Ask` per step, to be sent
        back its logits (:func:`~gen_service.engine.scheduler.run_steps` runs them for
        this request alone; the service's batch loop, :mod:`gen_service.serving.batching`,
        with other requests')."""
        if job.candidates:
            yield from self._candidates_steps(job, cancelled)
            return
        seed = job.seed if job.seed is not None else draw_seed()
        built = self.policies(job)
        ref, cand = built.reference, built.candidates[0]
        p0, q0 = self.prefill_pair(ref, cand, job.prompt_ids, job.question_ids)
        yield self.header(job, seed, cand, ref, p0, q0)
        yield from steps(self._decode(job, p0, q0, seed, cancelled))

    def _decode(self, job: TraceJob, p0: Prefilled, q0: Prefilled, seed: int,
                cancelled: Callable[[], bool]) -> Iterator[Any]:
        """One candidate's decoding loop: records, and the :class:`Forward` lists it needs run."""
        if self.shared_prompt:
            for side in (p0.side, q0.side):
                share_prompt(side, job.horizon)
        return decode(job, p0, q0, seeded(self.device, seed), self.lm.eos_token_ids, self.device, cancelled,
                      readback_every=self.readback_every, force_replay=self.force_replay)

    def trace_candidates(self, job: TraceJob, cancelled: Callable[[], bool] = lambda: False) -> Iterator[Any]:
        """Several candidates against one reference, on one prompt, in one request
        (:meth:`trace` of a job with ``candidates``).

        P's prompt is prefilled once for all candidates (:meth:`prefill_document`):
        every candidate whose press compresses after each layer's attention derives its
        cache from that one forward, bit for bit what its own forward would give; the
        others prefill Q by a forward of their own. Each candidate then decodes with its
        own generator seeded with its own seed, drawing the same random numbers in the
        same order as its own request. Only the forwards are shared
        (:func:`gen_service.engine.scheduler.drive_many`): sides on the shared prompt
        path run stacked in one batch, P rows with P rows and Q rows with Q rows; sides
        that cannot stack (per-head masks, decoding-time presses, per-row copies) run
        their own forwards, exactly as alone. Stacking changes only the batch of the
        row-wise matmuls, whose last bits depend on the batch size on CPU, so traces
        equal one request per candidate to floating-point rounding (the tests find the
        same tokens); ``batch_candidates = False`` runs every forward alone and gives
        bit-identical traces.

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
        yield from run_steps(self._candidates_steps(job, cancelled), self.runner())

    def _candidates_steps(self, job: TraceJob, cancelled: Callable[[], bool]) -> Iterator[Any]:
        """:meth:`trace_candidates`'s items with the forwards left to the caller (:meth:`trace_steps`)."""
        policies = self.policies(job)
        ref, cands = policies.reference, policies.candidates
        runs, headers = [], []
        seeds = job.seeds or [None] * len(job.candidates)
        check(cancelled)
        pairs = self.prefill_document(ref, cands, job.prompt_ids, job.question_ids)
        check(cancelled)
        for i, (policy, seed, cand, pair) in enumerate(zip(job.candidates, seeds, cands, pairs, strict=True)):
            if isinstance(pair, Cancelled):
                raise pair
            if isinstance(pair, Exception):   # the first failing candidate is the request's 422
                raise CandidateError(i, policy, pair) from pair
            p0, q0 = pair
            seed = seed if seed is not None else draw_seed()
            one = replace(job, candidate=policy, seed=seed, candidates=[], seeds=[],
                          policies=Policies(ref, (cand,)))
            runs.append((one, seed, p0, q0))
            headers.append(self.header(one, seed, cand, ref, p0, q0))
        yield from headers   # only once every prefill ran: a policy failing there is a 422
        loops = [self._decode(one, p0, q0, seed, cancelled) for one, seed, p0, q0 in runs]
        yield from steps_many(job.candidates, loops)

    # ------------------------------------------------------------------ TGI generate

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], policy: Policy | str, max_new_tokens: int, sampling: Sampling,
                 seed: int | None, top_n: int = 0, stop_check: Callable[[list[int]], bool] | None = None,
                 cancelled: Callable[[], bool] = lambda: False) -> Iterator[dict[str, Any]]:
        """Plain sampling from one policy's kernel (TGI's /generate): yields one dict per
        token with id, logprob (the model's, as TGI reports it) and top tokens, and
        finally a dict with the finish reason. ``policy``: as the intake built it
        (gen_service/serving/intake.py), or an id, built here (tests driving the engine)."""
        if isinstance(policy, str):
            policy = self.registry.build(policy, ModelInfo.of(self.lm))
        pre = self.prefill(policy, prompt_ids)
        gen = seeded(self.device, seed if seed is not None else draw_seed())
        yield from generate(pre, self.step, gen, self.lm.eos_token_ids, self.device, prompt_ids, max_new_tokens,
                                sampling, top_n, stop_check, cancelled)

    def prompt_logprobs(self, prompt_ids: list[int]) -> list[float | None]:
        """Log-probabilities of each prompt token under the full model (TGI prefill details)."""
        return prompt_logprobs(self.model, prompt_ids)


def _attempt(make: Callable[[], Any]) -> Any:
    """``make()``, or the exception it raised (one candidate's failure, reported in order)."""
    try:
        return make()
    except Exception as exc:
        return exc
