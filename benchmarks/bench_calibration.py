"""Calibration of divstats' inference layer, printed as tables.

1. Paired tests (Wilcoxon, paired t, sign-flip permutation): rejection rate under
   the null (type-I error at alpha = 0.05) and under a shift (power), and coverage
   of the effect-size intervals (the test's own, the mean difference's t interval,
   the Hodges–Lehmann interval, and the bootstrap interval for the mean).
2. Gap decomposition: coverage of the paired bootstrap intervals (BCa and
   percentile) for gap, Δfirst, Δexposure, Δrate against the population truth.
3. Whole plans on simulated traces: family-wise rejection under a true null
   (four identical policies, six pairwise hypotheses in one Holm family).

Usage: python benchmarks/bench_calibration.py [--quick]
The figures quoted in docs/plans.md come from the default (non-quick) run.
"""

from __future__ import annotations

import argparse
import itertools
import time

from divstats.calibration import (
    PolicyEffect,
    decomposition_coverage,
    paired_calibration,
    simulate_study,
)
from divstats.planrun import run_plan


def paired_table(n_sims: int, sizes: list[int], shift: float) -> None:
    print(f"\n## Paired tests (alpha = 0.05, two-sided; differences = shift + 0.1 * t5; {n_sims} simulations)")
    print(f"{'test':<12}{'n':>4}  {'size':>6}  {'power':>6}  {'cov(effect)':>11}  {'cov(mean t)':>11}"
          f"  {'cov(HL)':>8}  {'cov(mean boot)':>14}")
    for test in ("wilcoxon", "ttest", "permutation"):
        for n in sizes:
            null = paired_calibration(test, n_docs=n, n_sims=n_sims, shift=0.0, seed=n)
            alt = paired_calibration(test, n_docs=n, n_sims=n_sims, shift=shift, seed=1000 + n)
            boot = paired_calibration(test, n_docs=n, n_sims=max(n_sims // 4, 50), shift=shift, seed=2000 + n,
                                      mean_ci="bootstrap")
            print(f"{test:<12}{n:>4}  {null.rejection_rate:>6.3f}  {alt.rejection_rate:>6.3f}  "
                  f"{null.effect_coverage:>11.3f}  {null.mean_ci_coverage:>11.3f}  {null.hl_ci_coverage:>8.3f}"
                  f"  {boot.mean_ci_coverage:>14.3f}")
    print(f"(power at shift = {shift}; cov(effect), cov(mean t), cov(HL): coverage of the 95% intervals "
          f"under the null; cov(mean boot): coverage of the BCa bootstrap interval for the mean at the "
          f"shift, with a quarter of the simulations)")


def decomposition_table(n_sims: int, sizes: list[int], n_resamples: int) -> None:
    print(f"\n## Gap decomposition: coverage of 95% paired bootstrap intervals ({n_sims} simulations, "
          f"{n_resamples} resamples)")
    print(f"{'method':<12}{'n docs':>7}  {'gap':>6}  {'first':>6}  {'exposure':>8}  {'rate':>6}")
    for method in ("BCa", "percentile"):
        for n in sizes:
            cov = decomposition_coverage(n_docs=n, n_sims=n_sims, method=method, n_resamples=n_resamples,
                                         seed=n)
            c = cov.coverage
            print(f"{method:<12}{n:>7}  {c['gap']:>6.3f}  {c['first']:>6.3f}  {c['exposure']:>8.3f}  "
                  f"{c['rate']:>6.3f}")


def plan_null_table(n_studies: int) -> None:
    print(f"\n## Whole plan under the null on simulated traces ({n_studies} studies; 30 docs, T = 10, "
          "12 replicates; four identical policies; six pairwise occurrence hypotheses, one Holm family, "
          "split = all)")
    policies = {p: PolicyEffect(0.06) for p in ("a", "b", "c", "d")}
    hyps = [{"id": f"{x}-{y}", "family": "null", "metric": "occurrence", "compare": [x, y], "split": "all"}
            for x, y in itertools.combinations(policies, 2)]
    plan = {"plan": {"name": "null", "alpha": 0.05, "salt": "bench", "confirmatory_fraction": 0.5},
            "windows": {}, "hypothesis": hyps}
    any_reject = raw = 0
    for s in range(n_studies):
        ds = simulate_study(30, policies, horizon=10, replicates=12, seed=10_000 + s)
        t = run_plan(ds, plan, n_resamples=999).table
        any_reject += bool(t["reject"].any())
        raw += int((t["p_value"] < 0.05).sum())
    print(f"family-wise rejection rate (Holm): {any_reject / n_studies:.3f}   "
          f"raw per-hypothesis rejection rate: {raw / (6 * n_studies):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller simulations (about 20 s)")
    args = ap.parse_args()
    t0 = time.time()
    if args.quick:
        paired_table(300, [10, 30], shift=0.08)
        decomposition_table(60, [30], 999)
        plan_null_table(4)
    else:
        paired_table(2000, [10, 20, 50], shift=0.08)
        decomposition_table(400, [20, 50], 1999)
        plan_null_table(40)
    print(f"\n(total {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
