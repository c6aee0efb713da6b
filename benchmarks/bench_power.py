"""Predicted power (divstats.power) vs the rejection rate observed on simulated studies.

For each design (test, direction, documents n, replicates R) a pool of simulated
documents (``divstats.truth.studies.simulate_study``, residual traces, two policies)
is the population; studies are drawn from it and tested with ``paired_test``, and
the rejection rate is compared with ``power_at`` computed with the pool as the
pilot (``divstats.calibration.power.power_calibration``).  The designs are those of
tests/test_divstats_power.py (12 designs; the slow test asserts |difference| <= 0.05).

Usage: python benchmarks/bench_power.py [--studies N]
The table quoted in docs/design.md comes from the default run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_divstats_power import DESIGNS  # noqa: E402  (one list of designs for test and benchmark)

from divstats.calibration.power import power_calibration  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--studies", type=int, default=2000, help="simulated studies per design (default 2000)")
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()
    start = time.perf_counter()
    table = pd.concat([power_calibration(designs, effects, n_studies=args.studies, n_sims=8000, seed=args.seed)
                       for effects, designs in DESIGNS.items()], ignore_index=True)
    print(f"\n## Predicted vs observed power ({args.studies} simulated studies per design, alpha = 0.05)")
    print(f"{'effects':<15}{'test':<13}{'direction':<11}{'n':>5}{'R':>4}  {'predicted':>9}  {'observed':>8}"
          f"  {'± se':>6}  {'diff':>7}")
    for r in table.itertuples(index=False):
        print(f"{r.effects:<15}{r.test:<13}{r.direction:<11}{r.n:>5}{r.R:>4}  {r.predicted:>9.3f}  "
              f"{r.observed:>8.3f}  {r.observed_se:>6.3f}  {r.difference:>+7.3f}")
    print(f"max |difference| = {table['difference'].abs().max():.3f} over {len(table)} designs; "
          f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
