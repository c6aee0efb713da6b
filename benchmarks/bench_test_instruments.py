"""Time of the instruments the statistical tests call thousands of times.

``divstats.exact`` and ``divstats.simulate`` (with the ``protocols.validate`` every
simulated dataset passes), ``replicate_influence`` (under every ``plan_round`` and
variance component), the signed-rank test's exact null law and a Wilcoxon p-value
with and without ``paired_test``'s effect intervals (``paired_pvalue``, what the
power calibration counts), the Hodges-Lehmann interval, a simulated study,
``is_lazy`` (which every estimator asks) and the sharp interval at several windows.
Each line is the median of a few calls, in ms.

Usage: python benchmarks/bench_test_instruments.py [--repeat N] [--against CHECKOUT [--rounds K]]

``--against`` times another checkout too (its code first on PYTHONPATH, this interpreter),
alternating the two K times, and prints each line's median over the rounds for both and
their ratio (the other checkout's time over this one's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

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
    ap.add_argument("--against", type=Path, help="another checkout to time alternately with this one")
    ap.add_argument("--rounds", type=int, default=3, help="alternations with --against")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.against is not None:
        _compare(args)
        return

    import divstats
    from divstats.estimation.components import replicate_influence
    from divstats.estimation.interval import interval_by_window
    from divstats.inference import location_tests
    from divstats.inference.effects import hodges_lehmann
    from divstats.inference.paired import paired_test
    from divstats.truth.studies import PolicyEffect, markov_kernels, simulate_study
    from protocols import validate
    from protocols.chunks import is_lazy

    p, q = markov_kernels(1000, 1, PolicyEffect(0.2), 4, 1.3)
    small = divstats.simulate(p, q, 4, 5, 3, seed=1)
    study = simulate_study(4, {"a": PolicyEffect(0.06), "b": PolicyEffect(0.15)}, horizon=5, replicates=20,
                           kind="residual", seed=0)
    wide = simulate_study(20, {"a": PolicyEffect(0.1), "b": PolicyEffect(0.2), "c": PolicyEffect(0.05)},
                          horizon=16, replicates=8, kind="residual", window=4)
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
        "hodges_lehmann n=10": lambda: hodges_lehmann(d[:10], 0.95, "two-sided"),
        "hodges_lehmann n=40": lambda: hodges_lehmann(d[:40], 0.95, "two-sided"),
        "simulate_study 20 docs x 3, R=20 T=10": lambda: simulate_study(
            20, {"a": PolicyEffect(0.05), "b": PolicyEffect(0.1), "c": PolicyEffect(0.2)}, horizon=10,
            replicates=20, kind="residual", seed=1),
        "is_lazy (4 docs x 2 residual)": lambda: is_lazy(study),
        "interval_by_window 20 docs x 3, 5 windows": lambda: interval_by_window(wide, [0, 1, 2, 3, 4]),
    }
    try:
        from divstats.inference.paired import paired_pvalue
        rows["paired_pvalue wilcoxon n=200"] = lambda: paired_pvalue(d, 0.0, "wilcoxon", "two-sided")
    except ImportError:   # an older checkout
        pass
    if args.json:   # one line for --against
        print(json.dumps({name: _ms(fn, args.repeat) for name, fn in rows.items()}))
        return
    for name, fn in rows.items():
        print(f"{name:38s} {_ms(fn, args.repeat):9.2f} ms", flush=True)


def _compare(args: argparse.Namespace) -> None:
    """This checkout against ``args.against``, alternating; medians per line and their ratio."""
    here = Path(__file__).resolve().parents[1]
    runs: dict[str, list[dict[str, float]]] = {"other": [], "this": []}
    for k in range(args.rounds):
        for label, root in (("other", args.against.resolve()), ("this", here)):
            env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
            out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--json", "--repeat",
                                  str(args.repeat)], env=env, cwd=root, capture_output=True, text=True, check=True)
            runs[label].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {k + 1}/{args.rounds}: {label} done", file=sys.stderr, flush=True)
    print(f"| line | {args.against} ms | this checkout ms | ratio |\n|---|---|---|---|")
    for name in runs["this"][0]:
        mine = statistics.median(r[name] for r in runs["this"])
        theirs = [r[name] for r in runs["other"] if name in r]
        other = statistics.median(theirs) if theirs else float("nan")
        print(f"| {name} | {other:.2f} | {mine:.2f} | {other / mine:.2f} |")


if __name__ == "__main__":
    main()
