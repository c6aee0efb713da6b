"""Bias of the adaptive collection's estimates (``kvdiv collect --target-se/--budget``), by simulation.

Each setting runs the whole procedure (``divstats.calibration.adaptive.simulate_adaptive``: a pilot,
then rounds allocated by ``divstats.plan_round`` with the command's settings, stacked as ``kvdiv pack``
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

from divstats.calibration.adaptive import bias_table, simulate_adaptive
from kvdiv.adaptive import AdaptiveSpec

TYPICAL = {"effects": (0.06, 0.15), "pilot_replicates": 3}
# rare divergence next to frequent, and a pilot of 2: the pilot's variance says least where it matters most
RARE = {"effects": (0.02, 0.3), "pilot_replicates": 2}
OCC, POST = {"occurrence": 0.02}, {"post_mismatch": 0.1}
SETTINGS = {
    "occurrence SE 0.02, 1 round (default)": (AdaptiveSpec(("occurrence",), target_se=OCC, max_rounds=1), TYPICAL),
    "occurrence SE 0.02, up to 3 rounds": (AdaptiveSpec(("occurrence",), target_se=OCC, max_rounds=3), TYPICAL),
    "budget 120, occurrence + loss, 1 round": (AdaptiveSpec(("occurrence", "loss"), budget=120), TYPICAL),
    "post_mismatch SE 0.1, rare, 1 round (default)": (AdaptiveSpec(("post_mismatch",), target_se=POST,
                                                                   max_rounds=1), RARE),
    "post_mismatch SE 0.1, rare, up to 3 rounds": (AdaptiveSpec(("post_mismatch",), target_se=POST,
                                                                max_rounds=3), RARE),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repetitions", type=int, default=300, help="runs of the whole procedure per setting")
    ap.add_argument("--docs", type=int, default=4, help="simulated documents (two policies each)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    start = time.perf_counter()
    print(f"{args.docs} documents x 2 policies, T = 5, W = 5, V = 4, {args.repetitions} repetitions per setting; "
          f"typical: {TYPICAL}; rare: {RARE}\n")
    print(f"{'setting':<48}{'metric':<15}{'estimate':<23}{'rel. bias':>10}{'± se':>8}{'max|z|':>8}"
          f"{'rounds':>8}{'R/pair':>8}")
    for name, (spec, population) in SETTINGS.items():
        sim = simulate_adaptive(spec.metrics, **spec.round_settings(), docs=args.docs, repetitions=args.repetitions,
                                seed=args.seed, **population)
        rounds, per_pair = float(sim["rounds"].mean()), float(sim["counted"].mean())
        for row in bias_table(sim, spec.metrics):
            print(f"{name:<48}{row['metric']:<15}{row['estimate']:<23}{row['relative_bias']:>+10.4f}"
                  f"{row['se']:>8.4f}{row['max_abs_z']:>8.2f}{rounds:>8.2f}{per_pair:>8.1f}", flush=True)
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
