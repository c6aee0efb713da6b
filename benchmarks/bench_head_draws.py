"""Benchmark: the float32 head's layout and the categorical draw, against what they replaced.

Two parts of every decoding step whose cost grows with the vocabulary, each timed
both ways in this one process, interleaved call by call (medians over ``--calls``):

- the head: ``"rows"`` (``F.linear``: x · Wᵀ, the engine before) against ``"columns"``
  ((W · xᵀ)ᵀ with at least ``MIN_COLUMNS`` rows, the engine now on the CPU;
  ``gen_service/models/float_head.py``), on the model's own head weight, at each of
  ``--rows``;
- the draw: ``torch.multinomial`` (before) against the inverse-CDF
  ``gen_service.engine.coupling.categorical`` (now), on softmax laws of that many rows
  over the model's vocabulary; and the inverse-CDF draw's float64 running sums in
  passes of 64 MB of rows (before) against the CPU's 4 MB (``CPU_CDF_BYTES``, now);

then, with ``--trace``, one grouped residual request through ``Engine.trace`` (the
demo's seven candidates, R = 2, T = 8, W = 7, a 130-token prompt) the old way
(``"rows"`` head, ``torch.multinomial``) and the new, alternately ``--repeats`` times:
the median per-repeat ratio.

Usage: ``python benchmarks/bench_head_draws.py --model gemma3-270m --trace``
(``--model smollm2-135m``, ``tiny:llama``; ``--device cuda`` on a GPU).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import statistics
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Any

import torch
from common import clock, interleaved

import gen_service.engine.coupling as coupling
import gen_service.models.float_head as float_head
from gen_service.engine.facade import Engine
from gen_service.engine.jobs import TraceJob
from gen_service.models.loading import load_model

DEMO_POLICIES = ["snapkv@0.5", "snapkv#64", "recent@0.5", "snapkv@0.9", "snapkv@0.3", "recent@0.3", "full"]


def large_passes(weights: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The inverse-CDF draw before on the CPU: rows in passes of ``CDF_BYTES`` (64 MB),
    now ``CPU_CDF_BYTES`` (the same draws: a row reads only its own weights)."""
    before = coupling.CPU_CDF_BYTES
    coupling.CPU_CDF_BYTES = coupling.CDF_BYTES
    try:
        return coupling.categorical(weights, gen)
    finally:
        coupling.CPU_CDF_BYTES = before


def multinomial(weights: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The draw before: ``torch.multinomial``, one sample per row."""
    return torch.multinomial(weights, 1, generator=gen).squeeze(-1)


@contextmanager
def old_path(model: torch.nn.Module) -> Any:
    """The engine as before: the "rows" head and ``torch.multinomial`` draws."""
    made = float_head.head32(model)
    before = coupling.categorical
    float_head._HEADS[model] = replace(made, layout="rows")
    coupling.categorical = multinomial
    try:
        yield
    finally:
        float_head._HEADS[model] = made
        coupling.categorical = before


def trace_seconds(engine: Engine, old: bool) -> float:
    job = TraceJob(prompt_ids=list(range(1000, 1130)), candidate="", candidates=DEMO_POLICIES,
                   seeds=list(range(len(DEMO_POLICIES))), kind="residual", horizon=8, replicates=2, window=7)
    t0 = clock(engine.device)
    with old_path(engine.lm.model) if old else nullcontext():
        n = sum(1 for r in engine.trace(job) if isinstance(r, dict))
    assert n > 0
    return clock(engine.device) - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--device", default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 16, 28, 64])
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--trace", action="store_true", help="also time one grouped residual request both ways")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    lm = load_model(args.model, device=args.device)
    head = float_head.head32(lm.model)
    dev, V = lm.device, head.weight.shape[0]
    print(f"model {lm.name}, device {dev}, head {tuple(head.weight.shape)} {head.weight.dtype}, "
          f"method {head.method}, layout now {head.layout}, {torch.get_num_threads()} threads")
    print("\n| part | rows | before (ms) | now (ms) | speed-up |\n|---|---|---|---|---|")
    gen = torch.Generator(device=dev)
    for rows in args.rows:
        x = torch.randn(rows, head.weight.shape[1], device=dev) * 4
        now = replace(head, layout="columns") if dev.type == "cpu" else head
        t = interleaved({"before": lambda x=x: float_head.project(replace(head, layout="rows"), x),
                         "now": lambda x=x, now=now: float_head.project(now, x)}, args.calls, dev)
        print(f"| head | {rows} | {t['before'] * 1e3:.1f} | {t['now'] * 1e3:.1f} | {t['before'] / t['now']:.2f} |")
        p = torch.softmax(torch.randn(rows, V, device=dev) * 3, -1)
        t = interleaved({"before": lambda p=p: multinomial(p, gen), "now": lambda p=p: coupling.categorical(p, gen)},
                        args.calls, dev)
        print(f"| draw | {rows} | {t['before'] * 1e3:.1f} | {t['now'] * 1e3:.1f} | {t['before'] / t['now']:.2f} |")
        t = interleaved({"before": lambda p=p: large_passes(p, gen), "now": lambda p=p: coupling.categorical(p, gen)},
                        args.calls, dev)
        print(f"| draw's passes | {rows} | {t['before'] * 1e3:.1f} | {t['now'] * 1e3:.1f} | "
              f"{t['before'] / t['now']:.2f} |")
    if args.trace:
        engine = Engine(lm)
        pairs = []
        for _ in range(args.repeats):
            old, new = trace_seconds(engine, True), trace_seconds(engine, False)
            pairs.append((old, new))
        print("\n| way | per repeat (s) | median s |\n|---|---|---|")
        for i, way in enumerate(("before (rows head, torch.multinomial)", "now")):
            xs = [p[i] for p in pairs]
            print(f"| {way} | {', '.join(f'{v:.2f}' for v in xs)} | {statistics.median(xs):.2f} |")
        print(f"\nmedian per-repeat speed-up: {statistics.median(o / n for o, n in pairs):.2f}x "
              f"(one grouped residual request: {len(DEMO_POLICIES)} candidates, R = 2, T = 8, W = 7, 130 tokens)")


if __name__ == "__main__":
    main()
