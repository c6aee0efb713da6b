"""Calibration of divstats' inference layer, printed as tables (the numbers in docs/plans.md).

1. Paired tests (Wilcoxon, paired t, sign-flip permutation, bootstrap-t) on a
   symmetric (shift + 0.1 t5) and a skewed (shift + 0.1 (Exp(1) - 1)) population of
   per-document differences whose MEAN is the shift: rejection rate for the mean at
   shift 0 (size, alpha = 0.05, two-sided), power at a shift, and coverage of the
   test's own interval (against its own estimand) and of the mean-difference
   intervals (t, and BCa bootstrap).
2. Intervals over documents for the gap decomposition: coverage of the gap, its
   parts (worst of Δfirst, Δexposure, Δrate) and their shares, by method
   (bootstrap-t, jackknife-t, BCa, percentile) x n documents (3, 5, 10, 20, 50) x
   population (symmetric, skewed); measured below the refusal threshold too.
3. A whole plan under the null on simulated traces: family-wise rejection.

Usage: python benchmarks/bench_calibration.py [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import time

from divstats.calibration import (
    POPULATIONS,
    PolicyEffect,
    decomposition_coverage,
    paired_calibration,
    simulate_study,
)
from divstats.planrun import run_plan
from divstats.resample import METHODS

TESTS = ("wilcoxon", "ttest", "permutation", "bootstrap-t")


def paired_table(n_sims: int, sizes: list[int], shift: float) -> None:
    print(f"\n## Paired tests (alpha = 0.05, two-sided; {n_sims} simulated studies per cell; "
          f"power at mean shift {shift})")
    print("| population | test | n | size for the mean | power | cov(test's CI) | cov(mean t CI) "
          "| cov(mean BCa CI) |")
    print("|---|---|---|---|---|---|---|---|")
    for pop, test, n in itertools.product(POPULATIONS, TESTS, sizes):
        kw = dict(n_docs=n, population=pop, n_resamples=999)
        null = paired_calibration(test, n_sims=n_sims, shift=0.0, seed=n, **kw)
        alt = paired_calibration(test, n_sims=n_sims, shift=shift, seed=1000 + n, **kw)
        boot = (paired_calibration("ttest", n_sims=max(n_sims // 2, 50), seed=2000 + n, mean_ci="bootstrap", **kw)
                if test == "ttest" else None)
        print(f"| {pop} | {test} | {n} | {null.rejection_rate:.3f} | {alt.rejection_rate:.3f} | "
              f"{null.effect_coverage:.3f} | {null.mean_ci_coverage:.3f} | "
              f"{'' if boot is None else f'{boot.mean_ci_coverage:.3f}'} |", flush=True)


def interval_table(n_sims: int, sizes: list[int], n_resamples: int) -> None:
    print(f"\n## Intervals over documents: gap decomposition, nominal 0.95 ({n_sims} studies per cell, "
          f"{n_resamples} resamples; measured below the refusal threshold of 10 documents too)")
    print("| population | method | n | gap | worst part | worst share | shares refused |")
    print("|---|---|---|---|---|---|---|")
    for pop, method, n in itertools.product(POPULATIONS, [m for m in METHODS if m != "auto"], sizes):
        res = decomposition_coverage(n_docs=n, n_sims=n_sims, method=method, n_resamples=n_resamples,
                                     seed=n, population=pop, min_docs=3)
        c = res.coverage
        parts = min(c["first"], c["exposure"], c["rate"])
        shares = min(c["share_first"], c["share_exposure"], c["share_rate"])
        print(f"| {pop} | {method} | {n} | {c['gap']:.3f} | {parts:.3f} | {shares:.3f} | "
              f"{res.shares_refused:.2f} |", flush=True)


def plan_null_table(n_studies: int) -> None:
    print(f"\n## Whole plan under the null on simulated traces ({n_studies} studies; 30 docs, T = 10, "
          "12 replicates; four identical policies; six pairwise occurrence hypotheses, bootstrap-t, one Holm "
          "family, split = all)")
    policies = {p: PolicyEffect(0.06) for p in ("a", "b", "c", "d")}
    hyps = [{"id": f"{x}-{y}", "family": "null", "metric": "occurrence", "compare": [x, y], "split": "all",
             "test": "bootstrap-t"} for x, y in itertools.combinations(policies, 2)]
    plan = {"plan": {"name": "null", "alpha": 0.05, "salt": "bench", "confirmatory_fraction": 0.5},
            "windows": {}, "hypothesis": hyps}
    any_reject = raw = 0
    for s in range(n_studies):
        ds = simulate_study(30, policies, horizon=10, replicates=12, seed=10_000 + s)
        t = run_plan(ds, plan, n_resamples=999).table
        any_reject += bool(t["reject"].any())
        raw += int((t["p_value"] <= 0.05).sum())
    print(f"family-wise rejection rate (Holm): {any_reject / n_studies:.3f}   "
          f"raw per-hypothesis rejection rate: {raw / (6 * n_studies):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller simulations (well under a minute)")
    args = ap.parse_args()
    t0 = time.time()
    if args.quick:
        paired_table(100, [10], shift=0.08)
        interval_table(60, [5, 20], 299)
        plan_null_table(2)
    else:
        paired_table(500, [10, 20, 50], shift=0.08)
        interval_table(400, [3, 5, 10, 20, 50], 399)
        plan_null_table(20)
    print(f"\n(total {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
