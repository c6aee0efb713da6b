"""Benchmark: the prompt stored once per request vs one copy per row (gen_service/attention/shared_cache.py).

On one model, prompt and horizon T, for each R in ``--rows``:

1. coupled decoding row-steps/s (prefill excluded) with the shared prompt and with the
   per-row copies of the old path (``Engine(shared_prompt=False)``), and their ratio;
2. KV memory per additional row, read off the caches after decoding (P + Q sides):
   the copies hold the prompt and the row's tokens; the shared path the row's tokens;
3. residual ÷ coupled request time at equal R and T, with where the time goes
   (prefill, survival steps, branches), on the shared path.

Step times are medians over the T − 1 steps of a run (and over ``--repeats`` runs),
both paths measured alternately in this one process so that load on the shared cores
hits both alike.

Usage: ``python benchmarks/bench_shared_prompt.py [--rows 16 64] [--steps 32]
[--prompt-tokens 746] [--model embedded] [--policy snapkv@0.5] [--repeats 3]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from common import chat_prompt_ids, clock  # noqa: E402  (same directory)

from gen_service.attention.shared_cache import SharedPromptCache, share_prompt  # noqa: E402
from gen_service.engine.coupling import seeded  # noqa: E402
from gen_service.engine.facade import Engine  # noqa: E402
from gen_service.engine.jobs import (
    Sampling,  # noqa: E402
    TraceJob,  # noqa: E402
)
from gen_service.engine.loops import decode  # noqa: E402
from gen_service.engine.scheduler import drive  # noqa: E402
from gen_service.models.loading import load_model  # noqa: E402


def _cache_bytes(cache: Any) -> int:
    if isinstance(cache, SharedPromptCache):
        return cache.row_bytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def coupled_decode(engine: Engine, ids: list[int], policy: str, rows: int,
                   steps: int) -> tuple[float, int, list[dict[str, Any]]]:
    """(median seconds of one coupled step — a forward pair plus the coupling, timed
    between consecutive step records so that a burst of load on the shared cores
    moves the median little —, the KV bytes per row afterwards on P + Q, and the records)."""
    reg = engine.registry
    job = TraceJob(prompt_ids=ids, candidate=policy, horizon=steps, replicates=rows, seed=0)
    p0, q0 = engine.prefill_pair(reg.build("full"), reg.build(policy), ids)
    if engine.shared_prompt:
        share_prompt(p0.side, steps)
        share_prompt(q0.side, steps)
    gen = seeded(engine.device, 0)
    records, stamps = [], []
    for rec in drive(decode(job, p0, q0, gen, engine.lm.eos_token_ids, engine.device,
                          readback_every=engine.readback_every), engine.runner()):
        stamps.append(time.perf_counter())
        records.append(rec)
    sec = statistics.median(b - a for a, b in zip(stamps, stamps[1:], strict=False))
    return sec, (_cache_bytes(p0.side.cache) + _cache_bytes(q0.side.cache)) // rows, records


def agreement(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> tuple[bool, float]:
    """(same tokens, largest |ΔTV|) between two runs' step records."""
    same = all(ra["x_token"] == rb["x_token"] and ra["y_token"] == rb["y_token"] for ra, rb in zip(a, b, strict=True))
    return same, max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra["tv"], rb["tv"], strict=True))


def request_phases(engine: Engine, ids: list[int], policy: str, kind: str, rows: int,
                   steps: int) -> dict[str, float]:
    """Wall time of one request split at the records: header (prefill), last step
    record (decoding / survival), the rest (branches)."""
    job = TraceJob(prompt_ids=ids, candidate=policy, kind=kind, horizon=steps, replicates=rows, seed=0,
                   sampling=Sampling())
    t0 = clock(engine.device)
    marks: dict[str, float] = {}
    for rec in engine.trace(job):
        now = time.perf_counter()
        if rec.get("type") == "header":
            marks["prefill"] = now - t0
        elif rec.get("type") in ("step", "shared_step"):
            marks["steps"] = now - t0
    total = clock(engine.device) - t0
    return {"prefill": marks["prefill"], "steps": marks["steps"] - marks["prefill"],
            "branches": total - marks["steps"], "total": total}


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--policy", default="snapkv@0.5")
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=746)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--no-requests", action="store_true", help="skip the residual ÷ coupled requests")
    args = ap.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    shared, copies = Engine(lm, shared_prompt=True), Engine(lm, shared_prompt=False)
    ids = chat_prompt_ids(shared.lm.tokenizer, args.prompt_tokens)
    T, pol = args.steps, args.policy
    print(f"model={lm.name} device={lm.device} dtype={lm.dtype} prompt={len(ids)} tokens T={T} "
          f"policy={pol} repeats={args.repeats} torch threads={torch.get_num_threads()}")
    coupled_decode(shared, ids, pol, 2, 3)      # warm-up both paths
    coupled_decode(copies, ids, pol, 2, 3)
    print(f"\n{'R':>5s} {'copies rs/s':>12s} {'shared rs/s':>12s} {'ratio':>6s} "
          f"{'KB/row copies':>14s} {'KB/row shared':>14s} {'same tokens':>12s} {'max |dTV|':>10s}")
    for R in args.rows:
        res: dict[str, list[tuple[float, int, list]]] = {"copies": [], "shared": []}
        for _ in range(args.repeats):
            res["copies"].append(coupled_decode(copies, ids, pol, R, T))
            res["shared"].append(coupled_decode(shared, ids, pol, R, T))
        sec = {k: statistics.median(r[0] for r in v) for k, v in res.items()}
        mem = {k: v[0][1] for k, v in res.items()}
        same, dtv = agreement(res["copies"][0][2], res["shared"][0][2])
        print(f"{R:5d} {R / sec['copies']:12.1f} {R / sec['shared']:12.1f} {sec['copies'] / sec['shared']:6.2f} "
              f"{mem['copies'] / 1024:14.0f} {mem['shared'] / 1024:14.0f} {str(same):>12s} {dtv:10.1e}")
    if args.no_requests:
        return
    R = args.rows[0]
    print(f"\nrequests on the shared path, R={R}, T={T} (seconds, median of {args.repeats}):")
    phases = {kind: _median([request_phases(shared, ids, pol, kind, R, T) for _ in range(args.repeats)])
              for kind in ("coupled", "residual")}
    print(f"{'kind':10s} {'prefill':>8s} {'steps':>8s} {'branches':>9s} {'total':>8s}")
    for kind, ph in phases.items():
        print(f"{kind:10s} {ph['prefill']:8.2f} {ph['steps']:8.2f} {ph['branches']:9.2f} {ph['total']:8.2f}")
    print(f"residual ÷ coupled: {phases['residual']['total'] / phases['coupled']['total']:.2f}")


if __name__ == "__main__":
    main()
