"""Per-step cost of each KV-compression mechanism relative to SnapKV, in both trace kinds.

For each policy, a whole /v1/traces request (prefill + T steps; residual: survival +
branches) is timed in the same process, repeated, and the median is divided by
SnapKV's median in the same kind, measured in the same run. Mechanisms: head-wise
masks (AdaKV), per-layer budgets (PyramidKV: residual branches are replayed),
decoding-time eviction (DecodingPress: a press hook on every decoding forward, replayed
residual branches), key re-rotation, key-channel pruning (ThinK), composition and
KIVI-quantized caches (per-row copies, re-quantized at each flush, replayed branches).

Usage: ``python benchmarks/bench_presses.py [--model embedded] [--rows 8] [--steps 16]
[--prompt-tokens 400] [--repeats 3] [--device cpu|cuda]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

from common import clock, prose_ids  # noqa: E402

from gen_service.engine.facade import Engine  # noqa: E402
from gen_service.engine.jobs import TraceJob  # noqa: E402
from gen_service.models.loading import load_model  # noqa: E402

POLICIES = {
    "SnapKV (baseline)": "snapkv@0.5",
    "head-wise: AdaKV(SnapKV)": "adakv@0.5",
    "per-layer: PyramidKV": "pyramidkv@0.5",
    "decoding-time: DecodingPress(Knorm)": "kvpress:DecodingPress(KnormPress)#{half}:compression_interval=4",
    "prefill+decoding: PrefillDecoding": "kvpress:PrefillDecodingPress(SnapKVPress@0.5, DecodingPress(KnormPress)"
                                         "#{half}):compression_interval=4",
    "re-rotation: KeyRerotation(Knorm)": "kvpress:KeyRerotationPress(KnormPress)@0.5",
    "key channels: Composed(SnapKV, ThinK)": "kvpress:ComposedPress(SnapKVPress@0.5, ThinKPress@0.5)",
    "SnapKV, residual branches replayed (forced)": "snapkv@0.5",
    "quantized: quant:kivi@2": "quant:kivi@2",
    "quantized: quant:kivi@2, flush every 4": "quant:kivi@2:residual_length=4",
    "quantized: SnapKV + quant:kivi@4": "snapkv@0.5+quant:kivi@4",
}
FORCED = "forced"   # rows whose label says so run the replayed-branch path on purpose: its price alone


def request_time(engine: Engine, job: TraceJob) -> float:
    t0 = clock(engine.device)
    for _ in engine.trace(job):
        pass
    return clock(engine.device) - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--only", default="", help="run only mechanisms whose label contains this (plus SnapKV)")
    args = ap.parse_args()
    engine = Engine(load_model(args.model, device=args.device))
    ids = prose_ids(engine.lm.tokenizer, args.prompt_tokens)
    for kind in ("coupled", "residual"):  # warm-up: first-call allocations and kernels
        request_time(engine, TraceJob(prompt_ids=ids, candidate="snapkv@0.5", kind=kind, horizon=2, replicates=2))
    t_start = time.perf_counter()
    print(f"model={engine.lm.name} device={engine.lm.device} prompt={len(ids)} rows={args.rows} "
          f"T={args.steps} repeats={args.repeats} (medians; ratio = median / SnapKV's median, same kind)")
    print(f"{'mechanism':42s} {'coupled s':>10s} {'ratio':>6s} {'residual s':>11s} {'ratio':>6s}")
    base: dict[str, float] = {}
    for label, policy in POLICIES.items():
        if args.only and args.only not in label and label != "SnapKV (baseline)":
            continue
        policy = policy.format(half=len(ids) // 2)
        engine.force_replay = FORCED in label
        row = []
        for kind in ("coupled", "residual"):
            times = [request_time(engine, TraceJob(prompt_ids=ids, candidate=policy, kind=kind, horizon=args.steps,
                                                   replicates=args.rows, seed=rep))
                     for rep in range(args.repeats)]
            med = statistics.median(times)
            base.setdefault(kind, med)
            row += [med, med / base[kind]]
        print(f"{label:42s} {row[0]:10.2f} {row[1]:6.2f} {row[2]:11.2f} {row[3]:6.2f}", flush=True)
    print(f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
