"""Time of the instruments the statistical tests call thousands of times.

``divstats.exact`` and ``divstats.simulate`` (with the ``protocols.validate`` every
simulated dataset passes), ``replicate_influence`` (under every ``plan_round`` and
variance component), the signed-rank test's exact null law and a Wilcoxon p-value
with and without ``paired_test``'s effect intervals (``paired_pvalue``, what the
power calibration counts).  Each line is the median of a few calls, in ms.

Usage: python benchmarks/bench_test_instruments.py [--repeat N]
Run it on two checkouts (PYTHONPATH) to compare them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
from scipy import stats


def _ms(fn: Callable[[], object], repeat: int) -> float:
    fn()   # warm caches and imports
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5, help="timed calls per line (median)")
    args = ap.parse_args()

    import divstats
    from divstats.estimation.components import replicate_influence
    from divstats.inference import location_tests
    from divstats.inference.paired import paired_test
    from divstats.truth.studies import PolicyEffect, markov_kernels, simulate_study
    from protocols import validate

    p, q = markov_kernels(1000, 1, PolicyEffect(0.2), 4, 1.3)
    small = divstats.simulate(p, q, 4, 5, 3, seed=1)
    study = simulate_study(4, {"a": PolicyEffect(0.06), "b": PolicyEffect(0.15)}, horizon=5, replicates=20,
                           kind="residual", seed=0)
    rng = np.random.default_rng(0)
    d = rng.standard_normal(200) + 0.1
    ranks = np.rint(2 * stats.rankdata(np.abs(d))).astype(np.int64)
    rows = {
        "exact V=4 T=5": lambda: divstats.exact(p, q, 4, 5),
        "simulate coupled R=3 T=5": lambda: divstats.simulate(p, q, 4, 5, 3, seed=2),
        "simulate residual R=64 T=8": lambda: divstats.simulate(p, q, 4, 8, 64, kind="residual", seed=2),
        "validate (R=3 T=5)": lambda: validate(small),
        "replicate_influence 4 docs x 2": lambda: replicate_influence(study),
        "signed-rank null law n=200": lambda: location_tests._signed_rank_null(ranks),
        "paired_test wilcoxon n=200": lambda: paired_test(d, 0.0, "wilcoxon", "two-sided"),
    }
    try:
        from divstats.inference.paired import paired_pvalue
        rows["paired_pvalue wilcoxon n=200"] = lambda: paired_pvalue(d, 0.0, "wilcoxon", "two-sided")
    except ImportError:   # an older checkout
        pass
    for name, fn in rows.items():
        print(f"{name:34s} {_ms(fn, args.repeat):9.2f} ms", flush=True)


if __name__ == "__main__":
    main()
