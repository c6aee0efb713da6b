"""The certified budget and the band over budgets, calibrated by simulation (docs/statistics.md §11).

    PYTHONPATH=. python benchmarks/bench_certify.py              # the tables of §11
    PYTHONPATH=. python benchmarks/bench_certify.py --quick      # 200 studies, a smoke run

Prints three Markdown tables: the familywise error of `divstats.certify_budget` (all
budgets at the margin; the first two inside and the rest at the margin; symmetric and
skewed populations; n = 50 and 100), its power against the true crossing, and the
simultaneous coverage of the max-|t| band (with the pointwise intervals' for contrast).
"""

from __future__ import annotations

import argparse
import time

from divstats.calibration.certification import band_calibration, certify_calibration


def _markdown(df, columns) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for _, row in df.iterrows():
        lines.append("| " + " | ".join(f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c])
                                       for c in columns) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sims", type=int, default=1000)
    ap.add_argument("--resamples", type=int, default=999)
    ap.add_argument("--quick", action="store_true", help="200 studies, 499 resamples")
    ap.add_argument("--band-sizes", default="10,20,50,100")
    args = ap.parse_args()
    sims, B = (200, 499) if args.quick else (args.sims, args.resamples)
    start = time.perf_counter()
    fw = certify_calibration(sims, n_resamples=B)
    print(f"## Familywise error and power ({sims} studies per cell, {B} resamples, 6 budgets, margin 0.05)\n")
    nulls = fw[fw["scenario"] != "crossing"]
    print(_markdown(nulls, ["scenario", "population", "n", "fwer", "se", "bound", "ok"]), flush=True)
    print()
    print(_markdown(fw[fw["scenario"] == "crossing"],
                    ["scenario", "population", "n", "fwer", "power", "mean_certified", "true_last"]))
    sizes = tuple(int(s) for s in args.band_sizes.split(","))
    band = band_calibration(sims, sizes, n_resamples=B)
    print(f"\n## Simultaneous coverage over 6 budgets, level 0.95 ({sims} studies per cell)\n")
    print(_markdown(band, ["population", "n", "band", "pointwise_joint", "pointwise_each", "critical", "bound",
                           "ok"]))
    print(f"\n{time.perf_counter() - start:.0f} s wall")


if __name__ == "__main__":
    main()
