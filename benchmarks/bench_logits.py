"""Benchmark: what computing the logits in float32 costs (gen_service/models/float_head.py), and what it changes.

On one model, dtype and device, coupled decoding (`full` vs ``--policy``, R rows, T
steps, the engine's real loop) with three output layers, alternately in this one
process so that load hits them alike:

- ``bf16-head``: the logits as transformers returns them, in the weights' dtype, then
  ``.float()`` (the engine before float32 logits);
- ``fp32-copy``: the final norm and the head in float32 with a cached float32 copy of
  the head weight (the engine before this change: 2.1 GB more for an 8B model);
- ``fp32-head``: the engine now: the head's own bf16 weight, float32 products and
  output (``split`` on CUDA with ``torch.mm(out_dtype=)``, else ``chunked``).

Reports per variant the median step time (over the T − 1 steps of a run, then over
``--repeats`` runs), row-steps/s (a row-step is one P token and one Q token), the
ratio of medians to ``bf16-head`` and the median of the per-repeat ratios (each
repeat runs every variant back to back, so those pairs share the machine's load);
then the output layer alone on R rows (the variants interleaved call by call, medians
over ``--head-calls``: the cost without the rest of the step's noise); then, on the
prompt's last R positions, how far the bf16-rounded logits are from the
float32 ones: the largest |Δlogit| and the mean and largest TV
between the two next-token laws at temperature 1; then ``numerics``: the largest
|Δ logit| and |Δ log p| of each way of computing the float32 product (the copy, the
chunked cast, the split GEMM — emulated with float32 products where ``torch.mm`` has no
``out_dtype``, as on CPU — and the bf16 head) against float64, on the model's head over
the prompt's final hidden states and, with ``--random-head V H``, on a random bf16
head of that shape, with the bytes each holds. For a float32 model the variants are
the same computation (ratio ~1, Δ = 0).

Usage (CPU, bf16 weights): ``python benchmarks/bench_logits.py --model embedded --dtype bfloat16
--rows 16 --steps 16 --prompt-tokens 400``; numerics only, with Llama's 128k × 4096 head:
``python benchmarks/bench_logits.py --model embedded --dtype bfloat16 --prompt-tokens 200
--numerics-only --random-head 128256 4096``; on a CUDA machine: ``python benchmarks/bench_logits.py
--model random:llama-8b --device cuda --dtype bfloat16 --rows 64 --steps 32 --prompt-tokens 2000``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import chat_prompt_ids, interleaved  # noqa: E402  (same directory)

import gen_service.engine.forwards as forwards  # noqa: E402
import gen_service.engine.prefill as prefill  # noqa: E402
from gen_service.engine.facade import Engine  # noqa: E402
from gen_service.engine.jobs import (
    Sampling,  # noqa: E402
    TraceJob,  # noqa: E402
)
from gen_service.models import float_head as fp32  # noqa: E402
from gen_service.models.loading import load_model  # noqa: E402

_COPIES: dict[int, torch.Tensor] = {}


def bf16_head(model: torch.nn.Module, logits_to_keep: int = 0, **inputs: Any) -> torch.Tensor:
    """The logits as the model returns them (its dtype), cast after."""
    return model(**inputs, logits_to_keep=logits_to_keep).logits.float()


def _copy(model: torch.nn.Module) -> torch.Tensor:
    """The float32 copy of the head the engine used to keep (made once per model here)."""
    w = model.get_output_embeddings().weight
    if id(model) not in _COPIES:
        _COPIES[id(model)] = w.detach().float()
    return _COPIES[id(model)]


def fp32_copy(model: torch.nn.Module, logits_to_keep: int = 0, **inputs: Any) -> torch.Tensor:
    """Float32 logits from a cached float32 copy of the head (the engine before)."""
    head = fp32.head32(model)
    decoder, norm, lin = fp32._parts(model)
    hook = None if head.norm is None else norm.register_forward_hook(lambda m, a, o: head.norm(a[0].float()))
    try:
        hidden = decoder(**inputs).last_hidden_state
    finally:
        if hook is not None:
            hook.remove()
    if logits_to_keep:
        hidden = hidden[:, -logits_to_keep:]
    return F.linear(hidden.float(), _copy(model), head.bias)


VARIANTS: dict[str, Callable[..., torch.Tensor]] = {"bf16-head": bf16_head, "fp32-copy": fp32_copy,
                                                     "fp32-head": fp32.logits}


@contextmanager
def output_layer(fn: Callable[..., torch.Tensor]):
    """Every engine forward through ``fn`` while inside (the engine's modules look the name up)."""
    before = forwards.fp32_logits, prefill.fp32_logits
    forwards.fp32_logits = prefill.fp32_logits = fn
    try:
        yield
    finally:
        forwards.fp32_logits, prefill.fp32_logits = before


def step_seconds(engine: Engine, ids: list[int], policy: str, rows: int, steps: int) -> float:
    """Median seconds between consecutive step records of one coupled request."""
    job = TraceJob(prompt_ids=ids, candidate=policy, horizon=steps, replicates=rows, seed=0, sampling=Sampling())
    stamps = []
    for rec in engine.trace(job):
        if rec.get("type") == "step":
            stamps.append(time.perf_counter())
    return statistics.median(b - a for a, b in zip(stamps, stamps[1:], strict=False))


@torch.inference_mode()
def head_seconds(engine: Engine, rows: int, calls: int) -> dict[str, float]:
    """The output layer alone on (rows, hidden) final hidden states, the variants
    interleaved call by call (after a warm-up call each): median seconds per call of each."""
    model, dev = engine.lm.model, engine.lm.device
    head = fp32.head32(model)
    w = model.get_output_embeddings().weight
    h = torch.randn(rows, 1, w.shape[1], device=dev)
    copy = _copy(model)
    runs = {"bf16-head": lambda: F.linear(h.to(w.dtype), w).float(),
            "fp32-copy": lambda: F.linear(h, copy),
            "fp32-head": lambda: fp32.project(head, h)}
    return interleaved(runs, calls, dev)


@torch.inference_mode()
def rounding(engine: Engine, ids: list[int], rows: int) -> dict[str, float]:
    """bf16-rounded vs float32 logits of the prompt's last ``rows`` positions."""
    model = engine.lm.model
    x = torch.tensor([ids], device=engine.lm.device)
    a = bf16_head(model, rows, input_ids=x)[0]
    b = fp32.logits(model, rows, input_ids=x)[0]
    tv = 0.5 * (a.softmax(-1) - b.softmax(-1)).abs().sum(-1)
    return {"max_abs_dlogit": float((a - b).abs().max()), "mean_tv": float(tv.mean()), "max_tv": float(tv.max())}


def _emulated_mm(a: torch.Tensor, b: torch.Tensor, *args: Any, out_dtype: torch.dtype | None = None,
                 **kw: Any) -> torch.Tensor:
    """``torch.mm`` with ``out_dtype`` where torch has none (CPU): float32 products of the
    bf16 inputs, as a GEMM with float32 accumulation computes them."""
    if out_dtype is None:
        return _MM(a, b, *args, **kw)
    return _MM(a.float(), b.float()).to(out_dtype)


_MM = torch.mm


@torch.inference_mode()
def head_numerics(w: torch.Tensor, x: torch.Tensor) -> dict[str, Any]:
    """Each way of computing the float32 head on float32 hidden states ``x`` (n, H)
    against float64: the largest |Δ logit| and |Δ log p|, and the bytes it holds."""
    ref = x.double() @ w.double().T
    ref_lp = ref.log_softmax(-1)
    emulate = not fp32._splittable(w)
    if emulate:
        torch.mm = _emulated_mm
    try:
        split = fp32._split(x, w)
    finally:
        torch.mm = _MM
    buffer = fp32._buffer(w)
    ways = {"fp32-copy": (F.linear(x, w.float()), w.numel() * 4),
            "chunked": (fp32._chunked(x, w, buffer), buffer.numel() * 4),
            "split" + (" (emulated)" if emulate else ""): (split, 0),
            "bf16-head": (F.linear(x.to(w.dtype), w).float(), 0)}
    out: dict[str, Any] = {"shape": list(w.shape), "rows": x.shape[0], "max_abs_logit": float(ref.abs().max())}
    for name, (y, held) in ways.items():
        out[name] = {"max_abs_dlogit": float((y.double() - ref).abs().max()),
                     "max_abs_dlogp": float((y.double().log_softmax(-1) - ref_lp).abs().max()),
                     "max_abs_dlogit_vs_fp32_copy": float((y - ways["fp32-copy"][0]).abs().max()),
                     "held_MiB": round(held / 2**20, 1)}
    return out


@torch.inference_mode()
def model_hidden(engine: Engine, ids: list[int]) -> torch.Tensor:
    """The float32 final hidden states (after the float32 norm) over the prompt."""
    model = engine.lm.model
    head = fp32.head32(model)
    decoder, _, _ = fp32._parts(model)
    seen: dict[str, torch.Tensor] = {}
    hook = model.model.norm.register_forward_hook(lambda m, a, o: seen.setdefault("h", a[0]))
    try:
        decoder(input_ids=torch.tensor([ids], device=engine.lm.device))
    finally:
        hook.remove()
    h = seen["h"][0].float()
    return (head.norm(h) if head.norm is not None else model.model.norm(h)).float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--policy", default="snapkv@0.5")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--head-calls", type=int, default=30, help="interleaved calls of the output layer alone")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--numerics-only", action="store_true", help="only the numerics of the head's computations")
    ap.add_argument("--random-head", nargs=2, type=int, metavar=("V", "H"),
                    help="numerics also on a random bf16 head of V x H (N(0, 0.02) weights, N(0, 4) hidden states)")
    args = ap.parse_args()
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    engine = Engine(lm)
    ids = chat_prompt_ids(engine.lm.tokenizer, args.prompt_tokens)
    head_w = lm.model.get_output_embeddings().weight.detach()
    numerics = {"model_head": head_numerics(head_w, model_hidden(engine, ids))}
    if args.random_head:
        gen = torch.Generator(device=lm.device).manual_seed(0)
        V, H = args.random_head
        w = (torch.randn(V, H, generator=gen, device=lm.device) * 0.02).to(torch.bfloat16)
        numerics["random_head"] = head_numerics(w, torch.randn(16, H, generator=gen, device=lm.device) * 2.0)
        del w
    if args.numerics_only:
        print(json.dumps({"model": lm.name, "device": str(lm.device), "method": fp32.head32(lm.model).method,
                          "numerics": numerics}, indent=1))
        return
    times: dict[str, list[float]] = {v: [] for v in args.variants}
    with output_layer(VARIANTS[args.variants[0]]):
        step_seconds(engine, ids, args.policy, args.rows, 3)   # warm-up
    for rep in range(args.repeats):
        for name in args.variants[rep % len(args.variants):] + args.variants[:rep % len(args.variants)]:
            with output_layer(VARIANTS[name]):
                times[name].append(step_seconds(engine, ids, args.policy, args.rows, args.steps))
    base = statistics.median(times[args.variants[0]])
    out: dict[str, Any] = {"model": lm.name, "device": str(lm.device), "dtype": str(lm.dtype).split(".")[-1],
                           "rows": args.rows, "steps": args.steps, "prompt_tokens": len(ids), "policy": args.policy,
                           "fp32_head_extra_bytes": fp32.extra_bytes(lm.model), "variants": {}}
    first = times[args.variants[0]]
    for name in args.variants:
        sec = statistics.median(times[name])
        paired = [t / b for t, b in zip(times[name], first, strict=True)]   # same repeat: same load
        out["variants"][name] = {"step_ms": round(sec * 1e3, 2), "row_steps_per_s": round(args.rows / sec, 1),
                                 "time_vs_" + args.variants[0]: round(sec / base, 3),
                                 "paired_time_ratios": [round(r, 3) for r in paired],
                                 "median_paired_time_ratio": round(statistics.median(paired), 3),
                                 "runs_ms": [round(t * 1e3, 1) for t in times[name]]}
    heads = head_seconds(engine, args.rows, args.head_calls)
    out["head_only"] = {name: {"ms": round(sec * 1e3, 3), "time_vs_bf16-head": round(sec / heads["bf16-head"], 3)}
                        for name, sec in heads.items()}
    out["rounding"] = rounding(engine, ids, min(args.rows, len(ids)))
    out["method"] = fp32.head32(lm.model).method
    out["numerics"] = numerics
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
