"""Bias of the adaptive collection's estimates (``kvdiv collect --target-se/--budget``), by simulation.

Each setting runs the whole procedure (``kvdiv.adaptive.simulate_adaptive``: a pilot,
then rounds allocated by ``kvdiv.adaptive.plan_round``, stacked as ``kvdiv pack``
stacks them) many times on simulated documents whose estimands ``divstats.exact``
knows, and reports, per metric, the bias of

- the estimate ``kvdiv analyze`` reports (rounds >= 1, the pilot left out), and
- the estimate that pools the pilot with the rounds it allocated,

as the mean over (document, policy) pairs of (estimate - exact) / exact, with its SE
over repetitions, the largest |z| of one pair's bias, and the mean rounds and
replicates (rounds >= 1) per pair.

Usage: python benchmarks/bench_adaptive.py [--repetitions N] [--docs D]
The table quoted in docs/design.md comes from the default run.
"""

from __future__ import annotations

import argparse
import time

from kvdiv.adaptive import AdaptiveSpec, bias_table, simulate_adaptive

SETTINGS = {
    "target SE 0.02 on occurrence, by cell, up to 3 rounds":
        AdaptiveSpec(("occurrence",), target_se={"occurrence": 0.02}),
    "target SE 0.02 on occurrence, by cell, 1 round":
        AdaptiveSpec(("occurrence",), target_se={"occurrence": 0.02}, max_rounds=1),
    "target SE 0.02 on occurrence, by policy, up to 3 rounds":
        AdaptiveSpec(("occurrence",), target_se={"occurrence": 0.02}, by="policy"),
    "budget 120 replicates, occurrence + loss, by cell":
        AdaptiveSpec(("occurrence", "loss"), budget=120),
    "target SE occurrence 0.03 + loss 0.15, by cell, up to 3 rounds":
        AdaptiveSpec(("occurrence", "loss"), target_se={"occurrence": 0.03, "loss": 0.15}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repetitions", type=int, default=300, help="runs of the whole procedure per setting")
    ap.add_argument("--docs", type=int, default=6, help="simulated documents (two policies each)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    start = time.perf_counter()
    print(f"{args.docs} documents x 2 policies (PolicyEffect 0.06, 0.15), T = 5, W = 5, V = 4, pilot R = 3, "
          f"{args.repetitions} repetitions per setting\n")
    print(f"{'setting':<64}{'metric':<12}{'estimate':<23}{'rel. bias':>10}{'± se':>8}{'max|z|':>8}"
          f"{'rounds':>8}{'R/pair':>8}")
    for name, spec in SETTINGS.items():
        sim = simulate_adaptive(spec, docs=args.docs, repetitions=args.repetitions, seed=args.seed)
        rounds, per_pair = float(sim["rounds"].mean()), float(sim["counted"].mean())
        for row in bias_table(sim, spec.metrics):
            print(f"{name:<64}{row['metric']:<12}{row['estimate']:<23}{row['relative_bias']:>+10.4f}"
                  f"{row['se']:>8.4f}{row['max_abs_z']:>8.2f}{rounds:>8.2f}{per_pair:>8.1f}", flush=True)
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
