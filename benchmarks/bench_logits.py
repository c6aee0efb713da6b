"""Benchmark: what computing the logits in float32 costs (gen_service/models/float_head.py), and what it changes.

On one model, dtype and device, coupled decoding (`full` vs ``--policy``, R rows, T
steps, the engine's real loop) with three output layers, alternately in this one
process so that load hits them alike:

- ``bf16-head``: the logits as transformers returns them, in the weights' dtype, then
  ``.float()`` (the engine before float32 logits);
- ``fp32-head``: the final norm and the head in float32 with the cached float32 head
  weight (the engine now);
- ``fp32-cast``: the same, casting the head weight to float32 chunk by chunk at every
  step instead of caching it (the alternative that saves the copy's memory).

Reports per variant the median step time (over the T − 1 steps of a run, then over
``--repeats`` runs), row-steps/s (a row-step is one P token and one Q token), the
ratio of medians to ``bf16-head`` and the median of the per-repeat ratios (each
repeat runs every variant back to back, so those pairs share the machine's load);
then the output layer alone on R rows (the variants interleaved call by call, medians
over ``--head-calls``: the cost without the rest of the step's noise); then, on the
prompt's last R positions, how far the bf16-rounded logits are from the
float32 ones: the largest |Δlogit| and the mean and largest TV
between the two next-token laws at temperature 1. For a float32 model the variants
are the same computation (ratio ~1, Δ = 0).

Usage (CPU, bf16 weights): ``python benchmarks/bench_logits.py --model embedded --dtype bfloat16
--rows 16 --steps 16 --prompt-tokens 400``; on a CUDA machine: ``python benchmarks/bench_logits.py
--model random:llama-8b --device cuda --dtype bfloat16 --rows 64 --steps 32 --prompt-tokens 2000``
(the 8B shapes: a 128k x 4096 head; the float32 copy takes 2.1 GB).
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
from bench_service import prompt_ids  # noqa: E402  (same directory)

import gen_service.engine.forwards as forwards  # noqa: E402
import gen_service.engine.prefill as prefill  # noqa: E402
from gen_service.engine.coupling import Sampling  # noqa: E402
from gen_service.engine.facade import Engine  # noqa: E402
from gen_service.engine.jobs import TraceJob  # noqa: E402
from gen_service.models import float_head as fp32  # noqa: E402
from gen_service.models.loading import load_model  # noqa: E402

CHUNK = 8192   # head rows cast per chunk in fp32-cast


def bf16_head(model: torch.nn.Module, logits_to_keep: int = 0, **inputs: Any) -> torch.Tensor:
    """The logits as the model returns them (its dtype), cast after."""
    return model(**inputs, logits_to_keep=logits_to_keep).logits.float()


def fp32_cast(model: torch.nn.Module, logits_to_keep: int = 0, **inputs: Any) -> torch.Tensor:
    """Float32 logits without the cached copy: the head weight cast chunk by chunk each call."""
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
    hidden = hidden.float()
    w = lin.weight
    return torch.cat([F.linear(hidden, w[i:i + CHUNK].float()) for i in range(0, w.shape[0], CHUNK)], -1)


VARIANTS: dict[str, Callable[..., torch.Tensor]] = {"bf16-head": bf16_head, "fp32-head": fp32.logits,
                                                     "fp32-cast": fp32_cast}


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
    interleaved call by call: median seconds per call of each."""
    model, dev = engine.lm.model, engine.lm.device
    head = fp32.head32(model)
    w = model.get_output_embeddings().weight
    h = torch.randn(rows, 1, w.shape[1], device=dev)
    runs = {"bf16-head": lambda: F.linear(h.to(w.dtype), w).float(),
            "fp32-head": lambda: F.linear(h, head.weight),
            "fp32-cast": lambda: torch.cat([F.linear(h, w[i:i + CHUNK].float()) for i in range(0, w.shape[0], CHUNK)],
                                           -1)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(calls):
        for name, fn in runs.items():
            t0 = _clock(dev)
            fn()
            times[name].append(_clock(dev) - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.inference_mode()
def rounding(engine: Engine, ids: list[int], rows: int) -> dict[str, float]:
    """bf16-rounded vs float32 logits of the prompt's last ``rows`` positions."""
    model = engine.lm.model
    x = torch.tensor([ids], device=engine.lm.device)
    a = bf16_head(model, rows, input_ids=x)[0]
    b = fp32.logits(model, rows, input_ids=x)[0]
    tv = 0.5 * (a.softmax(-1) - b.softmax(-1)).abs().sum(-1)
    return {"max_abs_dlogit": float((a - b).abs().max()), "mean_tv": float(tv.mean()), "max_tv": float(tv.max())}


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
    args = ap.parse_args()
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    engine = Engine(lm)
    ids = prompt_ids(engine, args.prompt_tokens)
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
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
