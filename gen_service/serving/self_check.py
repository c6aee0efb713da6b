"""The start-up self-check: the server's P is the model it was given, and its tokenizer
is the checkpoint's.

Everything kvdiv reports is a distance from the full-cache model P, so before
``kvdiv serve`` accepts a request it checks, on the model it loaded:

* **The decoding path.** Two ``/v1/traces`` requests of kind ``reference``, each with
  two candidates (``full`` and ``streaming@0.5``) and R = 2 replicates, run as real
  requests run (through the decoding batch when ``--max-batch-requests`` > 1, every
  candidate's forwards stacked), over a prompt longer than the model's longest sliding
  window or attention chunk, for :data:`STEPS` steps. Every log p of a token P sampled
  (and, for the ``full`` candidate, Q's) is compared with the model's own forward over
  the same tokens: the prompt through the model once, then every path's tokens teacher
  forced through it (the model's own attention and cache, transformers' code path). A
  difference beyond the tolerance refuses the start, naming the step, the side and
  the model's layer types beyond whose window the prompt runs.
* **A compressed press.** :data:`PROBES`: SnapKV, whose window attention takes the
  model's rotary embedding and attention path, runs one request over the same prompt.
  When it fails, the server still starts, with every press of that family (the press
  table's trait: ``window_attention``) refused on this model, the failure as the reason
  (``PolicyRegistry.disabled``; ``/v1/policies`` lists it, a request gets a permanent 422)
  rather than failing later inside a collection.
* **The tokenizer.** A fixed text's ids with the tokenizer the server serves against
  the checkpoint's own (:mod:`gen_service.models.tokenizer_reference`); the first differing
  token refuses the start.

``/info`` reports the result (``kvdiv.self_check``); ``kvdiv serve --no-self-check``
skips it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from transformers import DynamicCache

from gen_service.engine.jobs import CandidateDone, CandidateFailed, TraceJob
from gen_service.errors import ConfigError, PolicyError
from gen_service.models.float_head import logits as float32_logits
from gen_service.models.loading import LoadedModel
from gen_service.models.tokenizer_reference import CHECK_TEXT
from gen_service.presses.families import Refusal
from gen_service.presses.registry import ModelInfo

__all__ = ["PROBES", "STEPS", "SelfCheck", "SelfCheckFailed", "check_compression", "check_decoding",
           "check_tokenizer", "windows_by_type", "run_self_check", "tolerance_for"]

log = logging.getLogger("kvdiv.service")

STEPS = 16                  # decoding steps per path
REPLICATES = 2              # paths per candidate
CANDIDATES = ("full", "streaming@0.5")   # P stacked beside a compressed Q, as a study's requests run
SEEDS = (11, 12)            # one request each, decoded in one batch
#: compressed presses run at start (policy, the press table trait refused on failure)
PROBES = (("snapkv@0.5", "window_attention"),)
MIN_PROMPT = 48             # tokens, for a model without windows
# |Δ log p| allowed, by the weights' dtype: float32 decoding equals the model's forward to
# rounding (1e-5 measured on SmolLM2); half precisions round every layer's output, and
# a cached step and a whole-sequence forward round differently. A path that ignores a
# sliding window is off by nats (issue: 5-10 nats on Gemma 3).
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6, torch.bfloat16: 0.25, torch.float16: 0.1}


class SelfCheckFailed(ConfigError):
    """The model as kvdiv decodes it is not the model it was given (or the tokenizer is
    not the checkpoint's): the server refuses to start."""


@dataclass(frozen=True)
class SelfCheck:
    """What the start-up self-check found (``/info``'s ``kvdiv.self_check``).

    Attributes
    ----------
    passed : bool
    tolerance : float
        The largest |Δ log p| (nats) allowed between kvdiv's decoding and the model's forward.
    max_error : float
        The largest |Δ log p| found, over every step, path and side checked.
    seconds : float
        What the check cost at start (wall time).
    prompt_tokens, steps, paths : int
        The checked prompt's length, the steps of every path, the paths (requests ×
        candidates × replicates).
    windows : dict
        The model's windowed layer types and their windows (the prompt is longer than each).
    tokenizer : dict
        ``source`` (the checkpoint's tokenizer it was compared with, or None), ``tokens``
        (the fixed text's length in tokens) and ``first_difference`` (None when equal).
    compression : list of dict
        One per :data:`PROBES`: ``policy``, ``passed``, and ``refused`` (the reason every
        press with the trait ``family`` is refused on this model; None when it ran).
    message : str
        The failure, in words ("" when passed).
    """

    passed: bool
    tolerance: float
    max_error: float
    seconds: float
    prompt_tokens: int = 0
    steps: int = 0
    paths: int = 0
    windows: dict[str, int] = field(default_factory=dict)
    tokenizer: dict[str, Any] = field(default_factory=dict)
    compression: list[dict[str, Any]] = field(default_factory=list)
    message: str = ""

    def info(self) -> dict[str, Any]:
        """The JSON object ``/info`` reports."""
        return {"skipped": False, **asdict(self)}


def tolerance_for(dtype: torch.dtype) -> float:
    """The default tolerance for weights of ``dtype`` (:data:`TOLERANCE`)."""
    return TOLERANCE.get(dtype, 0.25)


def windows_by_type(config: Any) -> dict[str, int]:
    """The model's windowed layer types and their windows (tokens): sliding-window and
    chunked attention, as the config declares them.

    Examples
    --------
    >>> from types import SimpleNamespace as NS
    >>> windows_by_type(NS(sliding_window=512, layer_types=["sliding_attention", "full_attention"]))
    {'sliding_attention': 512}
    >>> windows_by_type(NS(sliding_window=None))
    {}
    """
    config = getattr(config, "text_config", None) or config
    out: dict[str, int] = {}
    types = set(getattr(config, "layer_types", None) or ())
    window = getattr(config, "sliding_window", None)
    if window and (not types or "sliding_attention" in types) and getattr(config, "use_sliding_window", True):
        out["sliding_attention"] = int(window)
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk and (not types or "chunked_attention" in types):
        out["chunked_attention"] = int(chunk)
    return out


def _layer_types(config: Any) -> dict[str, int]:
    config = getattr(config, "text_config", None) or config
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * int(config.num_hidden_layers))
    return {t: types.count(t) for t in dict.fromkeys(types)}


# ---------------------------------------------------------------------------- tokenizer

def check_tokenizer(lm: LoadedModel) -> dict[str, Any]:
    """Compare the served tokenizer's ids of :data:`CHECK_TEXT` with the checkpoint's own.

    Returns
    -------
    dict
        ``source``, ``tokens`` and ``first_difference`` (None when the ids agree; else
        ``{"index", "served", "checkpoint"}`` with the token pieces at that index).
    """
    served = [int(i) for i in lm.tokenizer.encode(CHECK_TEXT, add_special_tokens=False)]
    ref = lm.tokenizer_reference
    if ref is None:
        return {"source": None, "tokens": len(served), "first_difference": None}
    want = list(ref.ids)
    diff = None
    if served != want:
        i = next((k for k, (a, b) in enumerate(zip(served, want, strict=False)) if a != b), min(len(served), len(want)))

        def piece(ids: list[int]) -> str | None:
            return lm.tokenizer.convert_ids_to_tokens(ids[i]) if i < len(ids) else None

        diff = {"index": i, "served": piece(served), "checkpoint": piece(want),
                "served_tokens": len(served), "checkpoint_tokens": len(want)}
    return {"source": ref.source, "tokens": len(served), "first_difference": diff}


# ---------------------------------------------------------------------------- decoding

def _prompt(lm: LoadedModel, length: int) -> list[int]:
    """``length`` tokens of the check text, repeated, after the BOS where there is one."""
    tok = lm.tokenizer
    text_ids = list(tok.encode(CHECK_TEXT, add_special_tokens=False))
    bos = getattr(tok, "bos_token_id", None)
    ids = [] if bos is None else [int(bos)]
    while len(ids) < length:
        ids += text_ids
    return [i for i in ids[:length] if i < lm.vocab_size]


async def _run_requests(service: Any, jobs: list[TraceJob]) -> list[list[dict[str, Any]]]:
    """Run ``jobs`` as the server runs ``/v1/traces`` requests, all at once (so they
    share the decoding batch); each job's records, in order. They are the server's own
    work, before any client can call: ``--max-queue`` and ``--max-request-seconds``,
    limits on clients, do not apply (a server with ``--max-queue 1`` or a short deadline
    on a slow machine would otherwise refuse to start)."""
    async with AsyncExitStack() as stack:
        works = []
        for job in jobs:
            ticket = await stack.enter_async_context(service.admitted(own=True))
            works.append(service.start_trace(service.intake.admit_job(job, own=True), ticket, own=True))

        async def drain(work: Any) -> list[dict[str, Any]]:
            out = []
            async for item in work:
                if isinstance(item, CandidateFailed):
                    raise item.error
                if not isinstance(item, CandidateDone):
                    out.append(item)
            return out

        return list(await asyncio.gather(*(drain(w) for w in works)))


def _paths(records: list[dict[str, Any]], candidate: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, log p, log q) of one candidate's reference steps: (R, T) each."""
    steps = sorted((r for r in records if r.get("type") == "reference_step" and r.get("candidate") == candidate),
                   key=lambda r: r["step"])
    x = torch.tensor([r["x_token"] for r in steps]).T
    lp = torch.tensor([[float("nan") if v is None else v for v in r["x_logp"]] for r in steps],
                      dtype=torch.float64).T
    lq = torch.tensor([[float("nan") if v is None else v for v in r["x_logq"]] for r in steps],
                      dtype=torch.float64).T
    return x, lp, lq


@torch.no_grad()
def model_logprobs(lm: LoadedModel, prompt: list[int], tokens: torch.Tensor) -> torch.Tensor:
    """log p(x_t | prompt, x_<t) by the model's own forward: (paths, T) float64.

    The prompt goes through the model once; its cache, repeated for every path, then
    takes all the paths' tokens teacher forced in one forward (the model's own
    attention, masks and cache layers, sliding ones included). Logits in float32
    (:func:`gen_service.models.float_head.logits`, the model's own logits for a float32 model)."""
    model, n = lm.model, tokens.shape[0]
    ids = torch.tensor([prompt], device=lm.device)
    cache = DynamicCache(config=model.config)
    first = float32_logits(model, logits_to_keep=1, input_ids=ids, past_key_values=cache, use_cache=True)
    steps = [first[:, -1].expand(n, -1)]
    if tokens.shape[1] > 1:
        cache.batch_repeat_interleave(n)
        rest = float32_logits(model, input_ids=tokens[:, :-1].to(lm.device), past_key_values=cache, use_cache=True)
        steps += list(rest.unbind(1))
    law = torch.stack(steps, 1).double().log_softmax(-1)
    return law.gather(-1, tokens.to(lm.device)[..., None]).squeeze(-1).cpu()


def _alive(tokens: torch.Tensor, eos: tuple[int, ...]) -> torch.Tensor:
    """Steps up to each path's first EOS (inclusive): after it the loops' laws are the
    EOS's point mass, which the model's forward does not know."""
    is_eos = torch.isin(tokens, torch.tensor(list(eos), dtype=tokens.dtype)) if eos else torch.zeros_like(tokens,
                                                                                                        dtype=bool)
    before = torch.cumsum(is_eos.long(), 1) - is_eos.long()
    return before == 0


def check_decoding(service: Any, tolerance: float, steps: int = STEPS) -> dict[str, Any]:
    """Run the checked requests through ``service`` and compare with the model's forward.

    Returns
    -------
    dict
        ``max_error``, ``first`` (the first step beyond ``tolerance``, None when there
        is none: side, candidate, request, replicate, step, position, error),
        ``prompt_tokens``, ``steps``, ``paths``, ``windows``.
    """
    lm = service.engine.lm
    windows = windows_by_type(lm.model.config)
    length = max(MIN_PROMPT, max(windows.values(), default=0) + 32)
    length = min(length, lm.max_context - steps - 1)
    prompt = _prompt(lm, length)
    jobs = [TraceJob(prompt_ids=prompt, candidate=CANDIDATES[0], kind="reference", horizon=steps,
                     replicates=REPLICATES, seed=seed, candidates=list(CANDIDATES), seeds=[seed] * len(CANDIDATES),
                     doc="self-check") for seed in SEEDS]
    # a fresh loop on a helper thread: the caller may be inside an event loop itself
    with ThreadPoolExecutor(1) as pool:
        results = pool.submit(asyncio.run, _run_requests(service, jobs)).result()
    worst, first = 0.0, None
    paths = {(r, cand): _paths(records, cand) for r, records in enumerate(results) for cand in CANDIDATES}
    # every path shares the prompt: the model's own forward runs over all of them at once
    owns = model_logprobs(lm, prompt, torch.cat([x for x, _, _ in paths.values()])).split(
        [x.shape[0] for x, _, _ in paths.values()])
    for ((r, cand), (x, lp, lq)), own in zip(paths.items(), owns, strict=True):
        alive = _alive(x, lm.eos_token_ids)
        sides = [("P", lp)] + ([("Q (full)", lq)] if cand == "full" else [])
        for side, got in sides:
            err = torch.where(alive, (got - own).abs().nan_to_num(float("inf")), torch.zeros_like(own))
            worst = max(worst, float(err.max()))
            beyond = (err > tolerance).any(0).nonzero()
            if len(beyond) and (first is None or int(beyond[0]) + 1 < first["step"]):
                t = int(beyond[0])
                i = int(err[:, t].argmax())
                first = {"side": side, "candidate": cand, "request": r, "replicate": i, "step": t + 1,
                         "position": len(prompt) + t, "error": float(err[i, t])}
    return {"max_error": worst, "first": first, "prompt_tokens": len(prompt), "steps": steps,
            "paths": len(SEEDS) * len(CANDIDATES) * REPLICATES, "windows": windows}


def check_compression(service: Any, steps: int = 2) -> list[dict[str, Any]]:
    """Run each of :data:`PROBES` through the engine on the check prompt; a probe that
    fails marks its trait unavailable in the engine's registry (``disabled``), so every
    press with it is refused on this model with the failure as the reason.

    Returns
    -------
    list of dict
        ``policy``, ``family`` (the trait), ``passed`` and ``refused`` (None, or the reason).
    """
    lm, registry = service.engine.lm, service.engine.registry
    info = ModelInfo.of(lm)
    length = min(max(MIN_PROMPT, max(windows_by_type(lm.model.config).values(), default=0) + 32),
                 lm.max_context - steps - 1)
    prompt = _prompt(lm, length)
    out = []
    for policy, trait in PROBES:
        refused = None
        try:
            registry.build(policy, info)
            job = TraceJob(prompt_ids=prompt, candidate=policy, kind="coupled", horizon=steps, replicates=1,
                           seed=SEEDS[0], doc="self-check")
            for _ in service.engine.trace(job):
                pass
        except PolicyError as exc:
            if not exc.permanent:
                raise
            refused = str(exc)    # refused by design already: nothing to mark
        except Exception as exc:  # the press family cannot run here: refused, not a failed start
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            press = registry.build(policy, replace(info, features=None)).press_name
            registry.disabled[trait] = Refusal(
                press, type(lm.model).__name__,
                f"the start-up self-check's {policy} failed on this model ({type(exc).__name__}: {first})",
                f"kvdiv support for this model's rotary embedding or attention in {press}'s family "
                f"(the press table's {trait!r} presses)")
            refused = registry.disabled[trait].message
            log.warning("self-check: %s; every %r press is refused on this model", refused, trait)
        out.append({"policy": policy, "family": trait, "passed": refused is None, "refused": refused})
    return out


def _decoding_message(lm: LoadedModel, found: dict[str, Any], tolerance: float) -> str:
    w = found["first"]
    types = ", ".join(f"{t} × {n}" for t, n in _layer_types(lm.model.config).items())
    past = [f"{t} (window {n})" for t, n in found["windows"].items() if w["position"] >= n]
    where = (f"the prompt runs past the window of its {' and '.join(past)} layers, which kvdiv's decoding path "
             f"does not reproduce here" if past else "no window is involved: the attention itself differs")
    return (f"self-check failed on {lm.name}: {w['side']} log-probabilities (candidate {w['candidate']!r}, "
            f"request {w['request']}, replicate {w['replicate']}) differ from the model's own forward by "
            f"{w['error']:.3g} nats from step {w['step']} (position {w['position']}; tolerance {tolerance:g}, "
            f"largest difference {found['max_error']:.3g} nats). Its layers: {types}; {where}. Start with "
            f"--no-self-check only if you accept traces of a model other than the one loaded.")


def _tokenizer_message(lm: LoadedModel, tok: dict[str, Any]) -> str:
    d = tok["first_difference"]
    return (f"self-check failed on {lm.name}: the tokenizer served is not the checkpoint's: a fixed text is "
            f"{d['served_tokens']} tokens with it and {d['checkpoint_tokens']} with {tok['source']}; the first "
            f"differing token is #{d['index']}: {d['served']!r} served, {d['checkpoint']!r} the checkpoint's.")


def run_self_check(service: Any, tolerance: float | None = None, steps: int = STEPS) -> SelfCheck:
    """The start-up self-check of a built service (its engine, batch loop and tokenizer).

    Parameters
    ----------
    service : gen_service.service.Service
    tolerance : float, optional
        Largest |Δ log p| allowed (nats); default by the weights' dtype (:data:`TOLERANCE`).
    steps : int
        Decoding steps per path.

    Returns
    -------
    SelfCheck
        Passed.

    Raises
    ------
    SelfCheckFailed
        On a tokenizer that is not the checkpoint's, or decoding beyond the tolerance.
    """
    lm = service.engine.lm
    tol = tolerance_for(lm.dtype) if tolerance is None else float(tolerance)
    t0 = time.perf_counter()
    tok = check_tokenizer(lm)
    if tok["first_difference"] is not None:
        raise SelfCheckFailed(_tokenizer_message(lm, tok))
    found = check_decoding(service, tol, steps)
    if found["first"] is not None:
        raise SelfCheckFailed(_decoding_message(lm, found, tol))
    compression = check_compression(service)
    seconds = time.perf_counter() - t0
    check = SelfCheck(passed=True, tolerance=tol, max_error=found["max_error"], seconds=round(seconds, 3),
                      prompt_tokens=found["prompt_tokens"], steps=steps, paths=found["paths"],
                      windows=found["windows"], tokenizer=tok, compression=compression)
    log.info("self-check passed: max |Δ log p| %.2g (tolerance %g) over %d paths × %d steps at a %d-token "
             "prompt; tokenizer %s; %.2f s", check.max_error, tol, check.paths, steps, check.prompt_tokens,
             tok["source"] or "without a reference", seconds)
    return check
