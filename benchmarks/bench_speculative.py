"""Speculative decoding with Q as the draft: the estimator against exact enumeration and the algorithm.

For each kernel pair and γ the table gives the exact E[target calls]
(``divstats.exact_target_calls``), the estimate from reference traces
(``divstats.speculative``: the forward recursion over drafts accepted, on
P-samples with log p and log q) ± its SE, and the mean calls of the simulated
algorithm itself (``divstats.simulate_speculative``: draft from Q, verify with P,
resample) ± its SE, each with its z against the exact value; then the variance
ratio var(estimate) / var(algorithm) at the same number of paths (both SEs from
the same replicate count, so the ratio of squared SEs).  The kernel pairs are
those of tests/divstats_cases.py, a history-dependent V = 4 pair with EOS among them.

Usage: python benchmarks/bench_speculative.py [--replicates N]
The table in docs/statistics.md §10 comes from the default run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))   # the shared kernel pairs

from divstats_cases import CASES  # noqa: E402

import divstats as dv  # noqa: E402

#: (kernel pair, horizon T, the γs); the pairs' own horizons are raised where enumeration stays cheap.
PAIRS = [("markov3", 8, (1, 2, 4)), ("markov3_eos", 8, (1, 4)), ("near_point_mass", 8, (2, 6)), ("tv_one", 6, (3,)),
         ("hashed4_eos", 5, (1, 2, 4, 8))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicates", type=int, default=4000, help="paths per estimate and runs of the algorithm")
    args = ap.parse_args()
    n = args.replicates
    cases = {c.name: c for c in CASES}
    print(f"target calls: exact vs estimate from reference traces vs the simulated algorithm ({n} paths each)\n")
    print("| kernel (V, T, EOS) | γ | exact | estimate ± SE | z | algorithm ± SE | z | var ratio |")
    print("|---|---|---|---|---|---|---|---|")
    t0 = time.perf_counter()
    zs: list[float] = []
    for seed, (name, T, gammas) in enumerate(PAIRS):
        c = cases[name]
        ds = dv.simulate(c.p, c.q, c.vocab_size, T, n, kind="reference", seed=seed, eos=c.eos)
        spec = dv.speculative(ds, gamma=gammas).isel(doc=0, policy=0)
        for g in gammas:
            ex = dv.exact_target_calls(c.p, c.q, c.vocab_size, T, g, eos=c.eos).target_calls
            est = float(spec["target_calls"].sel(gamma=g))
            se = float(spec["target_calls_se"].sel(gamma=g))
            runs = dv.simulate_speculative(c.p, c.q, c.vocab_size, T, g, n, seed=1000 + seed * 10 + g,
                                           eos=c.eos)
            sim, sim_se = runs.calls.mean(), runs.calls.std(ddof=1) / n ** 0.5
            z_est = (est - ex) / se if se > 0 else 0.0
            z_sim = (sim - ex) / sim_se if sim_se > 0 else 0.0
            zs += [z_est, z_sim]
            ratio = (se / sim_se) ** 2 if sim_se > 0 else float("nan")
            eos = "-" if c.eos is None else c.eos
            print(f"| {name} ({c.vocab_size}, {T}, {eos}) | {g} | {ex:.4f} | {est:.4f} ± {se:.4f} "
                  f"| {z_est:+.2f} | {sim:.4f} ± {sim_se:.4f} | {z_sim:+.2f} | {ratio:.2f} |")
    print(f"\nlargest |z| {max(abs(z) for z in zs):.2f} over {len(zs)} comparisons; "
          f"{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
