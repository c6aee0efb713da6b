"""Batched coupled, residual-branch and reference decoding producing ``kvdiv.trace/1`` records.

One request = one prompt, a reference policy (P, default ``full``) and a candidate
policy (Q). The prompt is prefilled once per policy (P full, Q compressed by its
press during prefill); both caches are then expanded to R rows and every decoding
step runs one forward per model over all R rows, with explicit ``position_ids``
(prompt length + step − 1): the evicted cache is shorter than the sequence, and
letting transformers infer positions from the cache length would shift RoPE.

The package splits deciding from running, as vLLM does:

================  =====================================================================
module            what it holds
================  =====================================================================
``jobs``          the request (:class:`TraceJob`, its :class:`Sampling`, its policies built
                  once: :class:`Built`) and the signals besides records (:class:`CandidateDone`,
                  :class:`CandidateFailed`; the exceptions :class:`Cancelled` and
                  :class:`CandidateError` are in ``gen_service.errors``); torch-free
``coupling``      the coupling math (statistics.md §1, §2, §5): the processed laws, the
                  maximal coupling, the seeded generators
``top_logprobs``  a step's top-k log-probabilities and KL/entropy (``top_logprobs: k``)
``sides``         the data the loops and the scheduler exchange: :class:`Side` (one
                  model's cache and policy state), :class:`Forward`, :class:`Prefilled`
``prefill``       prefill under a press, the question after compression, P and Q from
                  one forward
``forwards``      running one side's forward (its masks and hooks on for that forward
                  only) or several shared-prompt sides' as one
``context``       :class:`~gen_service.engine.context.LoopContext`, what a loop reads
``loops``         the loop for a job's kind (``LOOPS``) and :func:`~gen_service.engine.loops.decode`
``coupled``       the coupled loop
``residual``      the residual loop's survival phase and the online branch point
``reference``     the reference loop: P samples, Q scores P's token on the same history
``branches``      the residual branches: prefixes of the survival caches, or replayed
``scheduler``     runs the forwards the loops ask for: alone, or stacked over candidates
                  (and, through a request's steps and asks, over requests)
``fusion``        whether P's and Q's stacks run as one forward (measured per shape)
``header``        the trace's header record
``generate``      TGI's ``/generate`` sampling and prompt log-probabilities
``facade``        :class:`Engine`, the thin object the service calls
================  =====================================================================

The decoding loops never run a forward themselves: they yield the :class:`Forward`
list a step needs (P's and Q's) and receive the logits back; the scheduler decides
how those run. Each side's per-head masks and decoding-press hooks are installed
around that side's forward only, so nothing leaks into the other model's forwards
through the shared modules.

Import from the submodules; this package exports nothing itself (docs/architecture.md).
"""

__all__: list[str] = []
