"""Calibration of divstats' inference layer, printed as tables (the numbers in docs/plans.md).

Every coverage is against a known truth of the simulation population (its mean,
pseudo-median, or the aggregate computed from two million documents), never
against a method's own output.

1. Paired tests (Wilcoxon, paired t, sign-flip permutation, bootstrap-t) on a
   symmetric (shift + 0.1 t5) and a skewed (shift + 0.1 (Exp(1) - 1)) population of
   per-document differences whose MEAN is the shift: rejection rate for the mean at
   shift 0 (size, alpha = 0.05, two-sided), power at a shift, and coverage of the
   test's interval as reported (against its own estimand; refused below
   resample.MIN_DOCS_MEAN_DIFFERENCE for the mean tests) and of the Hodges-Lehmann interval.
2. The mean difference's intervals alone (bootstrap-t = the default, t, BCa),
   two-sided and as a one-sided upper bound, measured below the refusal threshold too.
3. Intervals over documents for the report's aggregate estimates (worst of
   INTERVAL_QUANTITIES) and for the gap decomposition (gap, worst part, worst
   share), by method (hybrid-t = the default, bootstrap-t, jackknife-t, BCa,
   percentile) x n documents x population; measured below the thresholds too.
4. A whole plan under the null on simulated traces: family-wise rejection.
5. (--one-sided) Size for the mean of the mean tests (bootstrap-t, t) by side
   (greater, less, two-sided) x n x population, and power at a shift towards
   each side; bootstrap-t also without its refusal of one-sided tests below
   resample.MIN_DOCS_MEAN_BOUND (the behaviour before it).
6. (--margin) Tests at a margin (equivalence by TOST; non-inferiority, worse = larger
   and smaller) for bootstrap-t and t: size at the margin (true difference = +-delta,
   the worst case) and power at 0, by n x population x margin, measured without the
   refusal threshold (resample.MIN_DOCS_MARGIN, MIN_DOCS_MARGIN_T).
7. (--bounded) Means of values in [0, 1] (the bounded estimands) on interior and near-bound
   laws, symmetric and skewed: coverage, median width and whole-range count of the betting
   interval, the resampling interval (auto) and the narrower of the two, by n.

Usage: python benchmarks/bench_calibration.py [--quick] [--sims N] [--one-sided] [--margin] [--bounded]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import time

from divstats.calibration.coverage import (
    BOUNDED_LAWS,
    POPULATIONS,
    aggregate_coverage,
    bounded_coverage,
    decomposition_coverage,
    margin_calibration,
    mean_interval_coverage,
    paired_calibration,
)
from divstats.estimation.resample import METHODS
from divstats.plans.run import run_plan
from divstats.truth.studies import PolicyEffect, simulate_study

TESTS = ("wilcoxon", "ttest", "permutation", "bootstrap-t")
DEFAULT_METHOD = "hybrid-t"


def mc_se(p: float, n: int) -> float:
    """Monte Carlo SE of a proportion p estimated from n studies."""
    return math.sqrt(p * (1 - p) / n) if n else math.nan


def cell(x: float) -> str:
    return "refused" if math.isnan(x) else f"{x:.3f}"


def paired_table(n_sims: int, sizes: list[int], shift: float) -> None:
    print(f"\n## Paired tests (alpha = 0.05, two-sided; {n_sims} simulated studies per cell; "
          f"power at mean shift {shift})")
    print("| population | test | n | size for the mean | power | cov(test's CI as reported) | cov(HL CI) |")
    print("|---|---|---|---|---|---|---|")
    for pop, test, n in itertools.product(POPULATIONS, TESTS, sizes):
        kw = dict(n_docs=n, population=pop, n_resamples=999)
        null = paired_calibration(test, n_sims=n_sims, shift=0.0, seed=n, **kw)
        alt = paired_calibration(test, n_sims=n_sims, shift=shift, seed=1000 + n, **kw)
        print(f"| {pop} | {test} | {n} | {null.rejection_rate:.3f} | {alt.rejection_rate:.3f} | "
              f"{cell(null.effect_coverage)} | {null.hl_ci_coverage:.3f} |", flush=True)


def bounded_table(n_sims: int, sizes: list[int]) -> None:
    print(f"\n## Bounded means in [0, 1] (level 0.95; {n_sims} simulated studies per cell; coverage >= "
          f"{0.95 - 2 * mc_se(0.95, n_sims):.3f} is within 2 SE of 0.95)")
    print("| law | n | betting: coverage / median width | auto (hybrid-t): coverage / median width / whole range "
          "| narrower: coverage / median width | betting narrower in |")
    print("|---|---|---|---|---|---|")
    for law, n in itertools.product(BOUNDED_LAWS, sizes):
        t = time.time()
        c = bounded_coverage(law, n_docs=n, n_sims=n_sims, seed=n)
        print(f"| {law} | {n} | {c.coverage['betting']:.3f} / {c.median_width['betting']:.3f} "
              f"| {c.coverage['auto']:.3f} / {c.median_width['auto']:.3f} / {c.whole_range['auto']} "
              f"| {c.coverage['narrower']:.3f} / {c.median_width['narrower']:.3f} | {c.betting_chosen:.2f} |"
              f"  <!-- {time.time() - t:.0f} s -->", flush=True)


def one_sided_table(n_sims: int, sizes: list[int], shift: float) -> None:
    print(f"\n## Size for the mean by side (alpha = 0.05; {n_sims} simulated studies per cell; power at a "
          f"mean shift of {shift} towards the side: +{shift} for greater and two-sided, -{shift} for less)")
    print("| population | test | n | side | size | power | refused | size without refusal | "
          "power without refusal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for pop, test, n, side in itertools.product(POPULATIONS, ("bootstrap-t", "ttest"), sizes,
                                                ("greater", "less", "two-sided")):
        kw = dict(n_docs=n, population=pop, n_resamples=999, alternative=side, n_sims=n_sims,
                  unrefused=test == "bootstrap-t")
        null = paired_calibration(test, shift=0.0, seed=5000 + n, **kw)
        alt = paired_calibration(test, shift=-shift if side == "less" else shift, seed=6000 + n, **kw)
        un = (f"{null.rejection_unrefused:.3f} | {alt.rejection_unrefused:.3f}" if test == "bootstrap-t"
              else "= size | = power")
        print(f"| {pop} | {test} | {n} | {side} | {null.rejection_rate:.3f} | {alt.rejection_rate:.3f} | "
              f"{null.not_estimable:.2f} | {un} |", flush=True)


def mean_interval_table(n_sims: int, sizes: list[int]) -> None:
    print(f"\n## Mean-difference intervals, nominal 0.95 ({n_sims} studies per cell; measured below the "
          "refusal threshold too; 'less' = the one-sided upper bound, the side right skew shortens)")
    print("| population | method | n | two-sided | one-sided (less) | infinite (two-sided) |")
    print("|---|---|---|---|---|---|")
    for pop, method, n in itertools.product(POPULATIONS, ("bootstrap-t", "t", "bootstrap"), sizes):
        kw = dict(n_docs=n, n_sims=n_sims, population=pop, seed=3000 + n, n_resamples=999)
        two = mean_interval_coverage(method, **kw)
        one = mean_interval_coverage(method, alternative="less", **kw)
        print(f"| {pop} | {method} | {n} | {two.coverage:.3f} | {one.coverage:.3f} | {two.infinite:.2f} |",
              flush=True)


def document_tables(n_sims: int, sizes: list[int], n_resamples: int) -> None:
    methods = [m for m in METHODS if m != "auto"]
    print(f"\n## Intervals over documents, nominal 0.95 ({n_sims} studies per cell for {DEFAULT_METHOD}, "
          f"{max(n_sims // 4, 100)} for the others; {n_resamples} resamples; measured below the refusal "
          "thresholds too)")
    print("| population | method | n | aggregates (worst) | gap | worst part | worst share | shares refused |")
    print("|---|---|---|---|---|---|---|---|")
    for pop, method, n in itertools.product(POPULATIONS, methods, sizes):
        sims = n_sims if method == DEFAULT_METHOD else max(n_sims // 4, 100)
        kw = dict(n_docs=n, n_sims=sims, method=method, n_resamples=n_resamples, seed=n, population=pop,
                  min_docs=3)
        agg = aggregate_coverage(**kw)
        worst = min(agg.coverage, key=agg.coverage.get)
        c = decomposition_coverage(**kw)
        parts = min(c.coverage["first"], c.coverage["exposure"], c.coverage["rate"])
        shares = min(c.coverage["share_first"], c.coverage["share_exposure"], c.coverage["share_rate"])
        print(f"| {pop} | {method} | {n} | {agg.coverage[worst]:.3f} ({worst}) | {c.coverage['gap']:.3f} | "
              f"{parts:.3f} | {cell(shares)} | {c.shares_refused:.2f} |", flush=True)


def margin_table(n_sims: int, sizes: list[int], margins: list[float], tests: list[str]) -> None:
    print(f"\n## Tests at a margin (alpha = 0.05; {n_sims} studies per cell, without the refusal threshold; "
          "size at +delta / -delta = rejection rate at a true difference on the boundary of H0; power at 0; "
          "cov = coverage of the test's interval (1 - 2 alpha for equivalence) at that difference)")
    print("\n| test | alternative | population | delta | n | size at +delta | size at -delta | power at 0 | "
          "cov at 0 |\n|---|---|---|---|---|---|---|---|---|")
    cases = [("equivalence", "larger"), ("noninferiority", "larger"), ("noninferiority", "smaller")]
    for test, (alt, worse), pop, delta, n in itertools.product(tests, cases, POPULATIONS, margins, sizes):
        run = functools.partial(margin_calibration, test, alt, n_docs=n, margin=delta, population=pop,
                                worse=worse, n_sims=n_sims, seed=n)
        plus = run(shift=delta).rejection_rate if not (alt == "noninferiority" and worse == "smaller") else math.nan
        minus = run(shift=-delta).rejection_rate if not (alt == "noninferiority" and worse == "larger") else math.nan
        zero = run(shift=0.0)
        name = alt if alt == "equivalence" else f"noninferiority ({worse} worse)"
        fmt = lambda x: "–" if math.isnan(x) else f"{x:.3f}"  # noqa: E731
        print(f"| {test} | {name} | {pop} | {delta:g} | {n} | {fmt(plus)} | {fmt(minus)} | "
              f"{zero.rejection_rate:.3f} | {zero.coverage:.3f} |", flush=True)
    print(f"\nalpha + 2 SE with {n_sims} studies: {0.05 + 2 * mc_se(0.05, n_sims):.4f}")


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
    ap.add_argument("--quick", action="store_true", help="smaller simulations (about a minute)")
    ap.add_argument("--sims", type=int, default=1000,
                    help="studies per cell of the default interval methods (others: a quarter; paired tests: half)")
    ap.add_argument("--skip-plan", action="store_true", help="leave out the whole-plan null study")
    ap.add_argument("--one-sided", action="store_true",
                    help="only the size-by-side table (5) with --sims studies per cell")
    ap.add_argument("--margin", action="store_true",
                    help="only the tests-at-a-margin table (6) with --sims studies per cell")
    ap.add_argument("--bounded", action="store_true",
                    help="only the bounded-means table (7) with --sims studies per cell (--sizes: 5,10,20,50,100)")
    ap.add_argument("--tests", default="bootstrap-t,ttest", help="--margin: the tests (comma-separated)")
    ap.add_argument("--sizes", default="10,20,30,50,100", help="--margin: the document counts")
    ap.add_argument("--margins", default="0.05,0.1", help="--margin: the margins delta")
    args = ap.parse_args()
    t0 = time.time()
    sizes = [3, 5, 10, 20, 50]
    if args.margin:
        margin_table(args.sims, [int(x) for x in args.sizes.split(",")],
                     [float(x) for x in args.margins.split(",")], args.tests.split(","))
        print(f"\n(total {time.time() - t0:.0f} s)")
        return
    if args.bounded:
        bounded_table(args.sims, [int(x) for x in args.sizes.split(",")] if args.sizes != "10,20,30,50,100"
                      else [5, 10, 20, 50, 100])
        print(f"\n(total {time.time() - t0:.0f} s)")
        return
    if args.one_sided:
        one_sided_table(args.sims, [5, 10, 20, 30, 40, 50], shift=0.05)
        print(f"\nMonte Carlo SE of a rate near 0.05 with {args.sims} studies: {mc_se(0.05, args.sims):.4f}")
        print(f"\n(total {time.time() - t0:.0f} s)")
        return
    if args.quick:
        paired_table(100, [5, 10], shift=0.08)
        mean_interval_table(200, [5, 10])
        document_tables(200, [5, 20], 299)
        plan_null_table(2)
    else:
        n = args.sims
        paired_table(n // 2, sizes, shift=0.08)
        mean_interval_table(n, sizes)
        document_tables(n, sizes, 399)
        if not args.skip_plan:
            plan_null_table(20)
    n = 200 if args.quick else args.sims
    print(f"\nMonte Carlo SE of a coverage near 0.95 / 0.92: {mc_se(0.95, n):.4f} / {mc_se(0.92, n):.4f} "
          f"with {n} studies, {mc_se(0.95, n // 2):.4f} / {mc_se(0.92, n // 2):.4f} with {n // 2}, "
          f"{mc_se(0.95, max(n // 4, 100)):.4f} / {mc_se(0.92, max(n // 4, 100)):.4f} with {max(n // 4, 100)}")
    print(f"\n(total {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
