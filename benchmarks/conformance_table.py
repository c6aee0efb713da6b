"""The conformance table: family × loop × max |Δ log p| against the model's own forward.

For every architecture of tests/conformance_models.py (a tiny random model per causal-LM
family, its attention features switched on, float32) and every loop through the engine
(tests/conformance_models.py ``LOOPS``), the largest difference between a log-probability
the engine reported for P (and for Q where Q is the full model) and the model's own
forward over the same tokens. tests/test_conformance.py asserts every cell ≤ 1e-4; this
prints the numbers as the markdown table of docs/measurements.md ("Conformance: P against the model's own forward").

Usage: ``python benchmarks/conformance_table.py [--families gemma2,gpt_oss] [--loops reference,generate]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from conformance_models import FAMILIES, LOOPS, loaded, run_loop  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="", help="comma-separated model types (default: all)")
    ap.add_argument("--loops", default="", help="comma-separated loop names (default: all)")
    args = ap.parse_args()
    fams = [f for f in FAMILIES if not args.families or f.model_type in args.families.split(",")]
    loops = [lp for lp in LOOPS if not args.loops or lp.name in args.loops.split(",")]
    print("| family | features | " + " | ".join(lp.name for lp in loops) + " |")
    print("|---|---|" + "---|" * len(loops))
    start, worst = time.perf_counter(), 0.0
    for fam in fams:
        lm = loaded(fam)
        cells = []
        for lp in loops:
            d = run_loop(lm, lp)
            worst = max(worst, d)
            cells.append(f"{d:.1e}")
        print(f"| {fam.model_type} | {fam.features} | " + " | ".join(cells) + " |", flush=True)
    print(f"\nlargest: {worst:.2e} ({len(fams)} families x {len(loops)} loops, "
          f"{time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
