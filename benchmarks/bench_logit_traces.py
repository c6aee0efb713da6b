"""Benchmark: what logit traces (``top_logprobs`` on /v1/traces) add to a stream, in bytes and in time.

On one model, the engine's real coupled and residual loops (``full`` vs ``--policy``, R rows,
T steps, one seed) run for k = 0 and every ``--k``, alternately in this one process so that
load hits them alike. Reports per kind and k:

- bytes per step per row: the wire bytes of the data records (``step``; ``shared_step`` and
  ``branch``) divided by the row-steps they carry (R·T; a residual stream's branch ages
  count as row-steps too), exactly as the collector journals them (NDJSON lines);
- the ratio of those bytes to k = 0;
- the median seconds of a whole request (over ``--repeats``) and its ratio to k = 0, with
  the median of the per-repeat ratios (each repeat runs every k back to back).

The numbers in docs/measurements.md ("Logit traces: size") come from
``python benchmarks/bench_logit_traces.py --model embedded --rows 8 --steps 32``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

from common import chat_prompt_ids  # noqa: E402  (same directory)

from gen_service.engine.facade import Engine  # noqa: E402
from gen_service.engine.jobs import TraceJob  # noqa: E402
from gen_service.models.loading import load_model  # noqa: E402
from protocols import StreamWriter  # noqa: E402


def run(engine: Engine, ids: list[int], kind: str, policy: str, rows: int, steps: int, k: int,
        seed: int) -> tuple[int, int, float]:
    """(data-record bytes, row-steps they carry, seconds) of one request."""
    w = StreamWriter()
    t0 = time.perf_counter()
    records = [r for r in engine.trace(TraceJob(prompt_ids=ids, candidate=policy, kind=kind, horizon=steps,
                                                replicates=rows, seed=seed, top_logprobs=k)) if isinstance(r, dict)]
    seconds = time.perf_counter() - t0
    data = [r for r in records if r["type"] in ("step", "shared_step", "branch")]
    size = sum(len(w.line(r)) for r in data)
    row_steps = sum(len(r["tv"]) for r in data)
    return size, row_steps, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--policy", default="snapkv@0.5")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--k", type=int, nargs="+", default=[5, 20, 64])
    ap.add_argument("--kinds", nargs="+", default=["coupled", "residual"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    lm = load_model(args.model)
    engine = Engine(lm)
    ids = chat_prompt_ids(engine.lm.tokenizer, args.prompt_tokens)
    ks = [0, *args.k]
    print(f"model {lm.name}, vocab {lm.vocab_size}, policy {args.policy}, R={args.rows}, T={args.steps}, "
          f"prompt {len(ids)} tokens, repeats {args.repeats}")
    print(f"{'kind':<9} {'k':>3} {'bytes/step/row':>15} {'x k=0':>7} {'median s':>9} {'x k=0':>7} "
          f"{'median of ratios':>17}")
    for kind in args.kinds:
        sizes: dict[int, float] = {}
        times: dict[int, list[float]] = {k: [] for k in ks}
        for _ in range(args.repeats):
            for k in ks:   # every k back to back within a repeat
                size, row_steps, seconds = run(engine, ids, kind, args.policy, args.rows, args.steps, k, args.seed)
                sizes[k] = size / row_steps
                times[k].append(seconds)
        for k in ks:
            ratios = [a / b for a, b in zip(times[k], times[0], strict=True)]
            med, base = statistics.median(times[k]), statistics.median(times[0])
            print(f"{kind:<9} {k:>3} {sizes[k]:>15.0f} {sizes[k] / sizes[0]:>7.1f} {med:>9.3f} {med / base:>7.2f} "
                  f"{statistics.median(ratios):>17.2f}")


if __name__ == "__main__":
    main()
