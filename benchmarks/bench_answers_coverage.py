"""Coverage of the answers' intervals over documents (docs/statistics.md §12, "Coverage of the paired interval").

For each scenario and number of documents n, simulate ``--studies`` studies with
``divstats.truth.answers.simulate_answer_scores`` (a known population accuracy and paired
difference) and count how often ``divstats.inference.answers.answer_interval`` (the one
call site of the answers' intervals) covers the truth: the paired difference Q − P and
Q's accuracy, at 95%.  A cell within 0.93-0.97 holds; one below says the interval must
be refused below that n.

    python benchmarks/bench_answers_coverage.py              # 2000 studies per cell
    python benchmarks/bench_answers_coverage.py --studies 300  # the smoke run
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from divstats.inference.answers import answer_interval
from divstats.truth.answers import simulate_answer_scores, true_difference

#: name -> (replicates, P's accuracy, lost, gained, Beta concentration of the documents)
SCENARIOS: dict[str, tuple[int, float, float, float, float]] = {
    "greedy R=1, Q loses 30%": (1, 0.6, 0.3, 0.05, 2.0),
    "sampled R=4, Q loses 40%": (4, 0.55, 0.4, 0.05, 2.0),
    "greedy R=1, rare flips (lost 5%)": (1, 0.8, 0.05, 0.0, 2.0),
    "greedy R=1, P at 95%, Q loses 10%": (1, 0.95, 0.1, 0.0, 20.0),
}
SIZES = (20, 50, 200)


def coverage(scenario: tuple[int, float, float, float, float], n: int, studies: int,
             rng: np.random.Generator) -> tuple[float, float, float]:
    """(coverage of Q − P, coverage of Q's accuracy, share of studies with a zero-width difference interval)."""
    r, px, lost, gained, conc = scenario
    truth_d = true_difference(px, lost, gained)
    truth_y = px * (1 - lost) + (1 - px) * gained
    hit_d = hit_y = flat = 0
    for _ in range(studies):
        x, y = simulate_answer_scores(n, r, x_accuracy=px, lost=lost, gained=gained, concentration=conc, rng=rng)
        _, lo, hi, _ = answer_interval((y - x).mean(axis=1), -1.0, 1.0)
        hit_d += lo <= truth_d <= hi
        flat += lo == hi
        _, lo, hi, _ = answer_interval(y.mean(axis=1), 0.0, 1.0)
        hit_y += lo <= truth_y <= hi
    return hit_d / studies, hit_y / studies, flat / studies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--studies", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    print(f"{args.studies} studies per cell\n")
    print("| scenario | n | Q − P covered | Q accuracy covered | zero-width Q − P |")
    print("|---|---|---|---|---|")
    for name, sc in SCENARIOS.items():
        for n in SIZES:
            cd, cy, flat = coverage(sc, n, args.studies, rng)
            print(f"| {name} | {n} | {cd:.3f} | {cy:.3f} | {flat:.3f} |", flush=True)
    print(f"\n{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
