"""Benchmark the divstats estimators (run: .venv/bin/python benchmarks/bench_estimators.py).

1. ``estimate`` on residual traces against a straightforward per-replicate, per-step
   Python loop computing the same docs/statistics.md §5 formulas on the same data
   (``loop_estimate``; the two agree to 1e-9).  Default configuration, the one of
   issue 20: 48 docs x 4 policies x 64 replicates x T = 48, W = 16 (``--docs``,
   ``--policies``, ``--replicates``, ``--horizon``, ``--window``).  Both are timed in
   each of ``--repeats`` interleaved rounds (default 5; ``estimate`` as the median of
   9 calls per round); the table gives the medians and the median ratio.  Target
   >= 30x.  Measured on the shared 2-core machine (``--loop-only``, three runs each,
   alternated): 54-62x (estimate 9.8-11.0 ms) before issue 20's fix, 96-105x
   (5.8-6.3 ms) after; the loop takes about 0.6 s.  ``--loop-only`` skips part 2.
2. Paper scale: 288 docs x 4 policies x 64 replicates x T = 512 residual traces,
   synthesised directly with numpy; time and peak memory of
   ``estimate`` + ``aggregate`` + ``sharp_interval``.  Targets: 10 s, 2 GB.

Peak memory is the process's peak resident set (VmHWM, reset just before the
measured calls, so it includes the ~0.75 GB dataset itself) and, separately, the
peak of new allocations traced by ``tracemalloc`` during the calls.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import divstats as dv  # noqa: E402
from protocols import residual_dataset  # noqa: E402


def synth_residual(docs: int, policies: int, reps: int, T: int, seed: int = 0, vocab: int = 50_000,
                   window: int | None = None):
    """Residual traces with the schema's masks, generated in per-doc chunks (low peak).

    ``window`` is the observation window W after the branch point (default T: the
    branches run to the end); the branches are observed at ages 0..min(W, T - t*).
    """
    W = T if window is None else int(window)
    rng = np.random.default_rng(seed)
    shape = (docs, policies, reps)
    stv = np.empty(shape + (T,), np.float32)
    stok = np.empty(shape + (T,), np.int32)
    bstep = np.zeros(shape, np.int32)
    btv = np.full(shape + (T,), np.nan, np.float32)
    bx = np.full(shape + (T,), -1, np.int32)
    by = np.full(shape + (T,), -1, np.int32)
    steps = np.arange(1, T + 1)
    for d in range(docs):
        sub = (policies, reps)
        scale = rng.uniform(2e-4, 4e-3, size=(policies, 1, 1))
        tv = rng.exponential(scale, size=sub + (T,)).clip(0, 1)
        # a few survival paths hit TV = 1 and stop there
        stop = np.where(rng.random(sub) < 0.02, rng.integers(1, T + 1, sub), T + 1)
        tv[steps == stop[..., None]] = 1.0
        dead = steps > stop[..., None]
        tv[dead] = np.nan
        stv[d] = tv
        tok = rng.integers(0, vocab, sub + (T,), dtype=np.int32)
        tok[steps >= stop[..., None]] = -1
        stok[d] = tok
        s = np.cumprod(1 - np.nan_to_num(tv), axis=-1)
        pi = np.concatenate([np.ones(sub + (1,)), s[..., :-1]], -1) * np.nan_to_num(tv)
        cum = np.cumsum(pi, -1)
        u = rng.random(sub) * cum[..., -1]
        ts = np.where(cum[..., -1] > 0, (cum < u[..., None]).sum(-1) + 1, 0).clip(0, T)
        bstep[d] = ts
        K = np.where(ts > 0, np.minimum(W, T - ts), -1)
        obs = np.arange(T) <= K[..., None]
        b = rng.uniform(0.05, 0.6, sub + (T,)).astype(np.float32)
        b[..., 0] = np.take_along_axis(tv, np.clip(ts - 1, 0, T - 1)[..., None], -1)[..., 0]
        x = rng.integers(0, vocab, sub + (T,), dtype=np.int32)
        differ = rng.random(sub + (T,)) < b
        differ[..., 0] = True
        y = np.where(differ, (x + 1 + rng.integers(0, vocab - 1, sub + (T,))) % vocab, x).astype(np.int32)
        btv[d] = np.where(obs, b, np.nan)
        bx[d] = np.where(obs, x, -1)
        by[d] = np.where(obs, y, -1)
    return residual_dataset(stv, stok, bstep, btv, bx, by, vocab_size=vocab, window=W,
                            docs=[f"d{i:03d}" for i in range(docs)],
                            policies=["snapkv@0.5", "snapkv#512", "recent@0.5", "snapkv@0.9"][:policies])


def loop_estimate(ds) -> dict[str, np.ndarray]:
    """The straightforward version: one Python iteration per replicate, docs/statistics.md §5 formulas.

    The branch mismatches are counted at ages 1..min(W, T - t*) (``window_mismatch``);
    with W >= T - 1 that is the whole post-divergence count (``post_mismatch``).
    """
    T, W = int(ds.attrs["horizon"]), int(ds.attrs.get("window", ds.attrs["horizon"]))
    stv, bs = ds.shared_tv.values, ds.branch_step.values
    bx, by = ds.branch_x_token.values, ds.branch_y_token.values
    D, P, R = bs.shape
    names = ("occurrence", "exposure", "rmtd", "window_mismatch") + (("post_mismatch",) if W >= T - 1 else ())
    out = {k: np.zeros((D, P)) for k in names}
    for d in range(D):
        for p in range(P):
            occ, exp_, rmtd, win = [], [], [], []
            for r in range(R):
                surv, total_exp, total_rmtd = 1.0, 0.0, 1.0
                for t in range(1, T + 1):
                    delta = stv[d, p, r, t - 1]
                    delta = 0.0 if np.isnan(delta) else float(delta)
                    total_exp += surv * delta * (T - t)
                    surv *= 1.0 - delta
                    if t < T:
                        total_rmtd += surv
                ts = bs[d, p, r]
                n_mis = 0
                if ts > 0:
                    for k in range(1, min(W, T - ts) + 1):
                        n_mis += bx[d, p, r, k] != by[d, p, r, k]
                occ.append(1 - surv)
                exp_.append(total_exp)
                rmtd.append(total_rmtd)
                win.append((1 - surv) * n_mis if ts > 0 else 0.0)
            for k, v in zip(names, (occ, exp_, rmtd, win, win), strict=False):
                out[k][d, p] = np.mean(v)
    return out


def vm_hwm_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reset_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def bench_loop(docs: int, policies: int, reps: int, T: int, window: int | None, repeats: int,
               calls: int = 9) -> list[tuple[str, str]]:
    """Ratio loop / ``estimate`` on one residual dataset, both timed in each of ``repeats`` rounds.

    A round times the loop once and ``estimate`` as the median of ``calls`` calls;
    the table gives the median over rounds (and the range) of each and of the ratio.
    """
    ds = synth_residual(docs, policies, reps, T, seed=1, window=window)
    est = dv.estimate(ds)
    ref = loop_estimate(ds)
    for k, v in ref.items():
        np.testing.assert_allclose(est[k].values, v, rtol=1e-9, atol=1e-12)
    t_vec, t_loop = [], []
    for _ in range(repeats):  # interleaved, so that both see the same load on the shared machine
        calls_t = []
        for _ in range(calls):
            t0 = time.perf_counter()
            dv.estimate(ds)
            calls_t.append(time.perf_counter() - t0)
        t_vec.append(float(np.median(calls_t)))
        t0 = time.perf_counter()
        loop_estimate(ds)
        t_loop.append(time.perf_counter() - t0)
    ratio = np.array(t_loop) / np.array(t_vec)
    W = int(ds.attrs["window"])
    size = f"{docs} docs x {policies} policies x {reps} replicates x T={T}, W={W}"

    def spread(x, unit=1.0, fmt=".1f"):
        return f"{np.median(x) * unit:{fmt}} (range {np.min(x) * unit:{fmt}}-{np.max(x) * unit:{fmt}})"

    return [("residual estimate vs loop", size),
            (f"estimate (vectorised), ms, median of {repeats} rounds", spread(t_vec, 1e3, ".2f")
             + f", each the median of {calls} calls"),
            ("per-replicate Python loop, s, same data", spread(t_loop, 1.0, ".3f")),
            ("speed-up (loop / vectorised), median", spread(ratio, 1.0, ".0f") + "x  (target >= 30x)")]


def bench_paper(docs: int, policies: int, reps: int, T: int) -> list[tuple[str, str]]:
    t0 = time.perf_counter()
    ds = synth_residual(docs, policies, reps, T, seed=2)
    t_synth = time.perf_counter() - t0
    data_mb = ds.nbytes / 2**20
    gc.collect()
    hwm_ok = reset_hwm()
    t0 = time.perf_counter()
    est = dv.estimate(ds)
    t_est = time.perf_counter() - t0
    t1 = time.perf_counter()
    agg = dv.aggregate(est)
    t_agg = time.perf_counter() - t1
    t1 = time.perf_counter()
    si = dv.sharp_interval(ds)
    t_si = time.perf_counter() - t1
    total = time.perf_counter() - t0
    hwm = vm_hwm_mb() if hwm_ok else float("nan")
    del est, agg, si
    gc.collect()
    tracemalloc.start()
    dv.aggregate(dv.estimate(ds))
    dv.sharp_interval(ds)
    traced = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    size = f"{docs} docs x {policies} policies x {reps} replicates x T={T}"
    return [
        ("paper scale", size),
        ("synthesise (not timed below)", f"{t_synth:.1f} s, dataset {data_mb:.0f} MiB"),
        ("estimate", f"{t_est:.2f} s"),
        ("aggregate", f"{t_agg:.3f} s"),
        ("sharp_interval", f"{t_si:.2f} s"),
        ("estimate + aggregate + sharp_interval", f"{total:.2f} s  (target <= 10 s)"),
        ("peak RSS during the calls (incl. dataset)", f"{hwm:.0f} MiB  (target <= 2048 MiB)"),
        ("peak new allocations (tracemalloc)", f"{traced:.0f} MiB"),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller paper-scale run (smoke test)")
    ap.add_argument("--loop-only", action="store_true", help="part 1 only (estimate vs the per-replicate loop)")
    ap.add_argument("--docs", type=int, default=48, help="part 1: documents (default 48)")
    ap.add_argument("--policies", type=int, default=4, help="part 1: policies, at most 4 (default 4)")
    ap.add_argument("--replicates", type=int, default=64, help="part 1: replicates R (default 64)")
    ap.add_argument("--horizon", type=int, default=48, help="part 1: horizon T (default 48)")
    ap.add_argument("--window", type=int, default=16, help="part 1: observation window W (default 16)")
    ap.add_argument("--repeats", type=int, default=5, help="part 1: interleaved rounds (default 5)")
    args = ap.parse_args()
    rows = [("cpus available", str(len(os.sched_getaffinity(0))))]
    rows += bench_loop(args.docs, args.policies, args.replicates, args.horizon, args.window, args.repeats)
    if not args.loop_only:
        rows += bench_paper(*((36, 4, 64, 512) if args.quick else (288, 4, 64, 512)))
    width = max(len(k) for k, _ in rows)
    print(f"{'benchmark':<{width}}  result")
    print("-" * (width + 40))
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
