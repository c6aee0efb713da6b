"""Benchmark: validate and open_traces on a paper-sized coupled dataset.

288 docs × 4 policies × 32 replicates × 256 steps (9.4 M steps per variable).
Reports wall time (best of ``--repeat``) and peak traced memory (tracemalloc,
which sees numpy's buffers), and the speed-up of the vectorised mismatch rule
over a naive per-replicate Python loop measured in the same run.

    .venv/bin/python benchmarks/bench_protocols.py [--docs 288] [--repeat 3]
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from protocols import open_traces, save_traces, validate
from protocols.examples import example_dataset
from protocols.validate import TV_ZERO_ATOL


def measure(fn, repeat: int) -> tuple[float, float]:
    """(best wall seconds, peak traced MiB of one run)."""
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    gc.collect()
    tracemalloc.start()
    fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return best, peak / 2**20


def naive_mismatch(ds) -> int:
    """The 'tokens differ ⇒ TV > 0' rule, one replicate at a time in plain Python."""
    tv, x, y = ds.tv.values, ds.x_token.values, ds.y_token.values
    bad = 0
    n_doc, n_pol, n_rep, _ = tv.shape
    for d in range(n_doc):
        for p in range(n_pol):
            for r in range(n_rep):
                xs, ys, ts = x[d, p, r].tolist(), y[d, p, r].tolist(), tv[d, p, r].tolist()
                bad += sum(1 for a, b, t in zip(xs, ys, ts, strict=True) if a != b and t <= TV_ZERO_ATOL)
    return bad


def vectorised_mismatch(ds) -> int:
    tv, x, y = ds.tv.values, ds.x_token.values, ds.y_token.values
    return int(((x != y) & (tv <= TV_ZERO_ATOL)).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=288)
    ap.add_argument("--policies", type=int, default=4)
    ap.add_argument("--replicates", type=int, default=32)
    ap.add_argument("--horizon", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    t0 = time.perf_counter()
    ds = example_dataset("coupled", docs=args.docs, policies=args.policies, replicates=args.replicates,
                         horizon=args.horizon, vocab_size=8, eos_token_id=0, seed=0)
    shape = f"{args.docs} docs × {args.policies} policies × {args.replicates} replicates × {args.horizon} steps"
    print(f"dataset: coupled, {shape} ({ds.nbytes / 2**20:.0f} MiB in memory; simulated in "
          f"{time.perf_counter() - t0:.1f} s)\n")

    rows = [("validate (all rules)", *measure(lambda: validate(ds), args.repeat), "")]
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in (".nc", ".zarr"):
            path = Path(tmp) / f"traces{fmt}"
            t0 = time.perf_counter()
            save_traces(ds, path, validate=False)
            wrote = time.perf_counter() - t0
            size = sum(f.stat().st_size for f in path.rglob("*")) if path.is_dir() else path.stat().st_size
            note = f"file {size / 2**20:.0f} MiB, save {wrote:.2f} s"
            rows.append((f"open_traces {fmt} (validate)",
                         *measure(lambda path=path: open_traces(path), args.repeat), note))
            rows.append((f"open_traces {fmt} (no validate)",
                         *measure(lambda path=path: open_traces(path, validate=False), args.repeat), ""))

    assert naive_mismatch(ds) == vectorised_mismatch(ds) == 0
    t_naive, m_naive = measure(lambda: naive_mismatch(ds), 1)
    t_vec, m_vec = measure(lambda: vectorised_mismatch(ds), args.repeat)
    rows.append(("mismatch rule, naive loop", t_naive, m_naive, "per-replicate Python loop"))
    rows.append(("mismatch rule, vectorised", t_vec, m_vec, f"{t_naive / t_vec:.0f}× faster than the loop"))

    print(f"{'operation':<34} {'time (s)':>9} {'peak MiB':>9}  notes")
    print("-" * 80)
    for name, sec, mib, note in rows:
        print(f"{name:<34} {sec:>9.3f} {mib:>9.0f}  {note}")
    print(f"\nfull validate is {t_naive / rows[0][1]:.1f}× faster than the naive loop for that one rule "
          f"(numpy {np.__version__})")


if __name__ == "__main__":
    main()
