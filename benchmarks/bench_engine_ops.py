"""Ops and time per stacked forward as groups are added, and the service against a naive loop.

1. **Ops per forward** (torch profiler: every ``aten::`` call) of one stacked decoding
   forward over G = 1, 4 and 8 groups (the demo's policies' Q sides, then their P
   sides: prompts of different lengths), attention batched over the groups in one
   call per layer (``STACKED_ATTENTION = "batched"``, the engine's) against the
   group-by-group loop (``"loop"``, the earlier way), and each one's time per forward
   (median of ``--repeats``, the two ways alternately).
2. **The service against a naive coupled loop** at ``--rows`` × ``--steps``: one
   prefill per side, the prompt cache repeated per row (``DynamicCache``), two forwards
   per step, the coupling math of ``gen_service.engine.coupling`` and one host read of the
   step's values per step, against ``Engine.trace`` as the server runs it (shared
   prompt, stacked or fused forwards, the readback every k steps). Whole requests,
   prefill included, alternately, after one warm-up of each (the fused-forward
   measurement of the engine's first step is kept for the life of a server). Then one
   service request under the profiler: its seconds in matrix products and attention
   kernels, arithmetic the naive loop does too, bound the speed-up any service could
   reach on this machine. With several ``--prompt-tokens`` a last table sets the
   lengths side by side.

Usage: ``python benchmarks/bench_engine_ops.py [--model embedded] [--rows 64] [--steps 16]
[--repeats 3] [--prompt-tokens 500 [1000 ...]] [--skip-naive] [--skip-ops]``.
"""

from __future__ import annotations

import os

# before torch loads OpenMP (see gen_service/api/cli.py)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import statistics  # noqa: E402

import torch  # noqa: E402
from common import clock, prose_ids  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import gen_service.attention.shared_cache as shared_cache  # noqa: E402
from gen_service.attention.shared_cache import share_prompt  # noqa: E402
from gen_service.engine.coupling import (  # noqa: E402
    absorb_eos,
    ended_on,
    maximal_coupling,
    probs,
    seeded,  # noqa: E402
)
from gen_service.engine.facade import Engine  # noqa: E402
from gen_service.engine.jobs import (
    Sampling,  # noqa: E402
    TraceJob,  # noqa: E402
)
from gen_service.engine.sides import Forward  # noqa: E402
from gen_service.models.loading import load_model  # noqa: E402

POLICIES = ["snapkv@0.5", "snapkv#72", "recent@0.5", "snapkv@0.9"]
# ---------------------------------------------------------------- 1. ops per forward

def group_forwards(engine: Engine, ids: list[int], groups: int, rows: int, steps: int) -> list[Forward]:
    """``groups`` stacked sides at their first decoding step: the policies' Q sides, then P's."""
    sides = []
    for policy in POLICIES:
        p0, q0 = engine.prefill_pair(engine.registry.build("full"), engine.registry.build(policy), ids)
        sides.append(q0)
        sides.append(p0)
    sides = (sides[0::2] + sides[1::2])[:groups]
    out = []
    for pre in sides:
        assert share_prompt(pre.side, steps)
        pre.side.rows(rows)
        tok = pre.logits.argmax(-1).expand(rows)
        out.append(Forward(pre.side, tok, torch.full((rows,), len(ids), dtype=torch.long)))
    return out


def _rewind(forwards: list[Forward]) -> None:
    """Undo a forward's write (its rows' next slot), as the fused-forward measurement does."""
    for f in forwards:
        for layer in f.side.cache.layers:
            layer.filled = 0


def ops_and_time(engine: Engine, forwards: list[Forward], mode: str, repeats: int) -> tuple[int, float]:
    shared_cache.STACKED_ATTENTION = mode
    engine._forward_stacked(forwards)        # warm-up (and the pool, built once per stack)
    _rewind(forwards)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine._forward_stacked(forwards)
    _rewind(forwards)
    ops = sum(1 for e in prof.events() if e.name.startswith("aten::"))
    times = []
    for _ in range(repeats):
        t0 = clock(engine.device)
        engine._forward_stacked(forwards)
        times.append(clock(engine.device) - t0)
        _rewind(forwards)
    return ops, statistics.median(times)


def bench_ops(engine: Engine, ids: list[int], rows: int, repeats: int) -> None:
    print(f"\n1. one stacked decoding forward, {rows} rows per group, prompt {len(ids)} tokens "
          f"(median of {repeats})\n")
    print("| groups | ops, loop | ops, batched | ms, loop | ms, batched | loop ÷ batched |")
    print("|---|---|---|---|---|---|")
    base = None
    for groups in (1, 4, 8):
        forwards = group_forwards(engine, ids, groups, rows, 4)
        loop_ops, loop_s = ops_and_time(engine, forwards, "loop", repeats)
        ops, s = ops_and_time(engine, forwards, "batched", repeats)
        base = base or ops
        print(f"| {groups} | {loop_ops} | {ops} ({ops / base:.2f}× G=1) | {loop_s * 1e3:.1f} | {s * 1e3:.1f} | "
              f"{loop_s / s:.2f} |")
    shared_cache.STACKED_ATTENTION = "batched"


# ---------------------------------------------------------------- 2. against a naive loop

@torch.inference_mode()
def naive_coupled(engine: Engine, ids: list[int], policy: str, rows: int, steps: int, seed: int) -> list[dict]:
    """The coupled trace the plain way: one prefill per side, R copies of each cache,
    two forwards per step, one host read per step."""
    p0, q0 = engine.prefill_pair(engine.registry.build("full"), engine.registry.build(policy), ids)
    for pre in (p0, q0):
        pre.cache.batch_repeat_interleave(rows)
    gen, sampling = seeded(engine.device, seed), Sampling()
    eos = torch.tensor(engine.lm.eos_token_ids, dtype=torch.long)
    lp, lq = p0.logits.expand(rows, -1), q0.logits.expand(rows, -1)
    x_end = y_end = torch.full((rows,), -1, dtype=torch.long)
    records = []
    for t in range(1, steps + 1):
        d = maximal_coupling(absorb_eos(probs(lp, sampling), x_end >= 0, x_end),
                             absorb_eos(probs(lq, sampling), y_end >= 0, y_end), gen)
        records.append({"tv": d.tv.tolist(), "x": d.x.tolist(), "y": d.y.tolist()})
        x_end, y_end = ended_on(x_end, d.x, eos), ended_on(y_end, d.y, eos)
        if t < steps:
            lp = engine.step(p0.side, d.x, torch.full((rows,), p0.side.next_pos + t - 1, dtype=torch.long))
            lq = engine.step(q0.side, d.y, torch.full((rows,), q0.side.next_pos + t - 1, dtype=torch.long))
    return records


def service_coupled(engine: Engine, ids: list[int], policy: str, rows: int, steps: int, seed: int) -> list[dict]:
    job = TraceJob(prompt_ids=ids, candidate=policy, kind="coupled", horizon=steps, replicates=rows, seed=seed,
                   sampling=Sampling())
    return [r for r in engine.trace(job) if r.get("type") == "step"]


MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def arithmetic_seconds(engine: Engine, ids: list[int], policy: str, rows: int, steps: int) -> dict[str, float]:
    """One service request under the profiler: its seconds in matrix products, in attention
    kernels (the fused SDPA ops) and in all.

    Both are arithmetic the naive loop does too (the same model, rows, head and keys
    attended), so naive ÷ their sum bounds the speed-up a service could reach on this
    machine by cutting everything else."""
    t0 = clock(engine.device)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        service_coupled(engine, ids, policy, rows, steps, 99)
    whole = clock(engine.device) - t0
    events = prof.key_averages()
    mm = sum(e.self_cpu_time_total for e in events if e.key in MATMULS) / 1e6
    attention = sum(e.self_cpu_time_total for e in events if "scaled_dot_product" in e.key) / 1e6
    return {"matmul": mm, "attention": attention, "whole": whole}


def bench_naive(engine: Engine, ids: list[int], rows: int, steps: int, repeats: int) -> dict:
    policy = POLICIES[0]
    runs = {"naive": naive_coupled, "service": service_coupled}
    for fn in runs.values():          # warm-up; the service's first step measures fusion once
        fn(engine, ids, policy, rows, steps, 0)
    times: dict[str, list[float]] = {name: [] for name in runs}
    out: dict[str, list[dict]] = {}
    for i in range(repeats):
        for name, fn in runs.items():
            t0 = clock(engine.device)
            out[name] = fn(engine, ids, policy, rows, steps, i + 1)
            times[name].append(clock(engine.device) - t0)
    same = sum(a == b for ra, rb in zip(out["naive"], out["service"], strict=True)
               for a, b in zip(ra["x"] + ra["y"], rb["x_token"] + rb["y_token"], strict=True))
    total = 2 * rows * steps
    dtv = max(abs(a - b) for ra, rb in zip(out["naive"], out["service"], strict=True)
              for a, b in zip(ra["tv"], rb["tv"], strict=True))
    print(f"\n2. a coupled request, {policy}, R = {rows}, T = {steps}, prompt {len(ids)} tokens, whole requests "
          f"({repeats} repeats, alternately)\n")
    print("| way | per repeat (s) | median s | speed-up |\n|---|---|---|---|")
    naive = statistics.median(times["naive"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {', '.join(f'{t:.2f}' for t in ts)} | {med:.2f} | {naive / med:.2f} |")
    ratios = [a / b for a, b in zip(times["naive"], times["service"], strict=True)]
    ar = arithmetic_seconds(engine, ids, policy, rows, steps)
    floor = ar["matmul"] + ar["attention"]
    print(f"\nper-repeat ratios {', '.join(f'{r:.2f}' for r in ratios)}; last repeat: same tokens "
          f"{same}/{total}, max |ΔTV| {dtv:.1e}; fused forward: {engine.fusion_info()['measured']}")
    print(f"a profiled service request: {ar['whole']:.2f} s, of which matrix products {ar['matmul']:.2f} s and "
          f"attention kernels {ar['attention']:.2f} s; naive ÷ their sum = {naive / floor:.2f}, the most a "
          f"service could reach by cutting everything else")
    return {"prompt": len(ids), "naive": naive, "service": statistics.median(times["service"]),
            "ratio": statistics.median(ratios), "floor": floor, **ar, "same": f"{same}/{total}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--ops-rows", type=int, default=8, help="rows per group in part 1")
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[500],
                    help="one or more prompt lengths (part 2 runs once per length)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-ops", action="store_true")
    ap.add_argument("--skip-naive", action="store_true")
    args = ap.parse_args()
    engine = Engine(load_model(args.model))
    lengths = [prose_ids(engine.lm.tokenizer, n) for n in args.prompt_tokens]
    print(f"model {args.model}, {torch.get_num_threads()} threads, device {engine.lm.device}")
    if not args.skip_ops:
        bench_ops(engine, lengths[0], args.ops_rows, args.repeats)
    if args.skip_naive:
        return
    rows = [bench_naive(engine, ids, args.rows, args.steps, args.repeats) for ids in lengths]
    print(f"\nthe service against the naive loop by prompt length (R = {args.rows}, T = {args.steps}, "
          f"medians)\n")
    print("| prompt tokens | naive s | service s | median per-repeat ratio | service's matmul + attention s "
          "| naive ÷ that | same tokens |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['prompt']} | {r['naive']:.2f} | {r['service']:.2f} | **{r['ratio']:.2f}** | "
              f"{r['matmul']:.2f} + {r['attention']:.2f} | {r['naive'] / r['floor']:.2f} | {r['same']} |")


if __name__ == "__main__":
    main()
