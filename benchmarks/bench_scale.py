"""Beyond memory: streaming pack to Zarr, then the analysis on dask (run: python benchmarks/bench_scale.py).

1. Pack: synthetic residual traces of ``--scale`` x the paper's size (paper: 288 docs x
   4 policies x 64 replicates x T = 512) are generated a few documents at a time and
   appended to a Zarr store with ``protocols.store.TraceStoreWriter`` (each piece
   validated), in a child process whose peak RSS is reported.  Target <= 1 GB.
2. Paper scale, in memory vs dask: ``estimate`` + ``aggregate`` + ``sharp_interval`` +
   ``run_plan(plans/paper.toml)`` on the 288-document store loaded into memory
   (baseline, median of ``--repeat`` runs), then the same calls on the store opened
   lazily (``open_traces(path, chunks="auto")``) on a local cluster of ``--workers``
   worker processes; the largest difference between the two results is reported
   (target: <= 1e-12, i.e. identical).
3. ``--scale`` x on dask: the same analysis on the big store with the same cluster,
   in one pass over the data (``divstats.traces.chunked.map_docs_many``), and, with
   ``--separate``, as the plain separate calls.  Reported: time per document against
   the in-memory time per document at paper scale (target: within 2x; median of
   ``--big-repeat`` runs), the CPU time per document of all processes (client,
   scheduler and workers) against the in-memory CPU time per document, the time to
   validate the big store chunk by chunk on the cluster, and each worker's peak RSS
   over all of it (target <= 1.5 GB).

Every number is measured in this run on this machine; ratios compare runs of the same
invocation.  The machine's load (other users) is printed with them: on a shared
machine the wall-time ratio depends on how many cores the others leave free, the CPU
time ratio much less.  ``--keep`` leaves the stores in ``--dir`` and ``--reuse``
analyses them again without packing, to repeat the measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

PAPER_DOCS, POLICIES, REPLICATES, HORIZON = 288, 4, 64, 512
PLAN = ROOT / "plans" / "paper.toml"


def vm_hwm_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# --------------------------------------------------------------------------- 1. pack (child process)

def pack(path: Path, docs: int, per_append: int, seed: int) -> dict:
    """Generate ``docs`` documents ``per_append`` at a time and stream them into ``path``."""
    from bench_estimators import synth_residual

    from protocols.store import TraceStoreWriter

    t_gen = t_write = 0.0
    t0 = time.perf_counter()
    with TraceStoreWriter(path) as w:
        for start in range(0, docs, per_append):
            n = min(per_append, docs - start)
            t1 = time.perf_counter()
            piece = synth_residual(n, POLICIES, REPLICATES, HORIZON, seed=seed + start)
            piece = piece.assign_coords(doc=np.array([f"d{start + i:05d}" for i in range(n)], dtype=object))
            t2 = time.perf_counter()
            w.append(piece)
            t_gen += t2 - t1
            t_write += time.perf_counter() - t2
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return {"docs": docs, "seconds": time.perf_counter() - t0, "generate_s": t_gen, "validate_write_s": t_write,
            "peak_rss_mb": vm_hwm_mb(), "disk_mb": size / 2**20}


def run_pack(path: Path, docs: int, per_append: int, seed: int) -> dict:
    if path.exists():
        shutil.rmtree(path)
    cmd = [sys.executable, __file__, "--pack-child", str(path), "--docs", str(docs), "--per-append",
           str(per_append), "--seed", str(seed)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode:
        raise SystemExit(f"pack failed:\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- 2./3. analysis

def analysis(ds, plan) -> dict:
    """estimate + aggregate + sharp_interval + run_plan, as separate public calls."""
    import divstats as D

    est = D.estimate(ds)
    return {"estimate": est, "aggregate": D.aggregate(est), "sharp_interval": D.sharp_interval(ds),
            "plan": D.run_plan(ds, plan, estimates=est, n_resamples=999, seed=0).table}


def analysis_one_pass(ds, plan) -> dict:
    """The same, reading each document chunk once (estimate, sharp_interval, branch_tv per chunk)."""
    import divstats as D
    from divstats.traces.chunked import map_docs_many

    out = map_docs_many({"estimate": (D.estimate, {}), "sharp_interval": (D.sharp_interval, {}),
                         "branch_tv": (D.branch_tv, {})}, ds)
    return {"estimate": out["estimate"], "aggregate": D.aggregate(out["estimate"]),
            "sharp_interval": out["sharp_interval"],
            "plan": D.run_plan(ds, plan, estimates=out["estimate"], branch=out["branch_tv"], n_resamples=999,
                               seed=0).table}


def max_diff(a: dict, b: dict) -> float:
    """Largest absolute difference over every number of two analysis results (NaN positions must agree)."""
    with np.errstate(invalid="ignore"):
        return _max_diff(a, b)


def _max_diff(a: dict, b: dict) -> float:
    worst = 0.0
    for key in ("estimate", "aggregate", "sharp_interval"):
        for name in a[key].data_vars:
            x, y = a[key][name].values, b[key][name].values
            if not np.array_equal(np.isnan(x), np.isnan(y)):
                return float("inf")
            if x.size:
                worst = max(worst, float(np.nanmax(np.abs(x - y), initial=0.0)))
    num = a["plan"].select_dtypes("number").columns
    x, y = a["plan"][num].to_numpy(float), b["plan"][num].to_numpy(float)
    if not np.array_equal(np.isnan(x), np.isnan(y)) or not a["plan"].drop(columns=num).equals(
            b["plan"].drop(columns=num)):
        return float("inf")
    return max(worst, float(np.nanmax(np.abs(x - y), initial=0.0)))


def cpu_seconds() -> float:
    """CPU time (user + system) of this process so far, all its threads."""
    t = os.times()
    return t.user + t.system


def timed(fn, *args, repeat: int = 1, client=None) -> tuple[object, float, list[float]]:
    """Result, median wall time and the wall times; ``timed.cpu`` is the median CPU time of a run.

    The CPU time is this process's (which hosts a local cluster's scheduler) plus, with
    ``client``, every worker's: unlike the wall time it does not depend on how many
    cores other users left free.
    """
    times, cpus, out = [], [], None
    for _ in range(repeat):
        w0 = client.run(cpu_seconds) if client is not None else {}
        c0, t0 = cpu_seconds(), time.perf_counter()
        out = fn(*args)
        times.append(time.perf_counter() - t0)
        workers = client.run(cpu_seconds) if client is not None else {}
        cpus.append((cpu_seconds() - c0, sum(v - w0[k] for k, v in workers.items())))
    timed.cpu = statistics.median(c + w for c, w in cpus)
    timed.cpu_workers = statistics.median(w for _, w in cpus)
    return out, statistics.median(times), times


def worker_peaks(client) -> list[float]:
    """Each worker process's peak resident set (VmHWM, MiB) since it started."""
    return [float(v) for v in client.run(vm_hwm_mb).values()]


class Table(list):
    """Rows printed as they are added (a long run shows its progress and keeps what it measured)."""

    def append(self, row: tuple[str, str]) -> None:
        super().append(row)
        print(f"{row[0]:<70}  {row[1]}", flush=True)

    def __iadd__(self, rows):
        for row in rows:
            self.append(row)
        return self


def warm_up() -> None:
    """Import the analysis stack in a worker, so that the first timed task does not pay for it."""
    import divstats  # noqa: F401


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=10.0, help="size of the big run in paper scales (default 10)")
    ap.add_argument("--paper-docs", type=int, default=PAPER_DOCS, help="documents of the paper-scale run")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3, help="in-memory baseline runs (median)")
    ap.add_argument("--per-append", type=int, default=8, help="documents per TraceStoreWriter.append")
    ap.add_argument("--separate", action="store_true", help="also time the big run as separate calls")
    ap.add_argument("--no-validate", action="store_true", help="skip validating the big store on the cluster")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/kvdiv-bench-scale"), help="where the stores go")
    ap.add_argument("--keep", action="store_true", help="keep the stores")
    ap.add_argument("--reuse", action="store_true",
                    help="analyse the stores a previous run left in --dir (with --keep) instead of packing anew")
    ap.add_argument("--big-repeat", type=int, default=1, help="runs of the big one-pass analysis (median)")
    ap.add_argument("--pack-child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--docs", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.pack_child:
        print(json.dumps(pack(args.pack_child, args.docs, args.per_append, args.seed)))
        return
    run(args)


def pack_rows(args, paper_path: Path, big_path: Path, big_docs: int, shape: str) -> list[tuple[str, str]]:
    """Pack both stores (each in a child process) and describe it."""
    p_small = run_pack(paper_path, args.paper_docs, args.per_append, seed=1)
    p_big = run_pack(big_path, big_docs, args.per_append, seed=2)
    return [
        (f"pack {args.paper_docs} docs {shape}", f"{p_small['seconds']:.1f} s, peak RSS {p_small['peak_rss_mb']:.0f} "
                                                 f"MiB, {p_small['disk_mb']:.0f} MiB on disk"),
        (f"pack {big_docs} docs (x{args.scale:g}) by TraceStoreWriter",
         f"{p_big['seconds']:.1f} s (generate {p_big['generate_s']:.0f} s, validate+write "
         f"{p_big['validate_write_s']:.0f} s), {p_big['disk_mb']:.0f} MiB on disk"),
        ("  peak RSS of the packing process", f"{p_big['peak_rss_mb']:.0f} MiB  (target <= 1024 MiB)"),
    ]


def run(args) -> None:
    import dask

    import divstats as D
    from protocols import open_traces, validate
    from protocols.chunks import dask_client

    big_docs = max(1, round(PAPER_DOCS * args.scale))
    args.dir.mkdir(parents=True, exist_ok=True)
    paper_path, big_path = args.dir / "paper.zarr", args.dir / f"x{args.scale:g}.zarr"
    rows = Table()
    rows += [("cpus / load average at start", f"{len(os.sched_getaffinity(0))} / {load()}"),
             ("dask", dask.__version__)]
    shape = f"x {POLICIES} policies x {REPLICATES} replicates x T={HORIZON}"

    t0 = time.perf_counter()
    if args.reuse and paper_path.exists() and big_path.exists():
        rows.append(("stores", f"reused from {args.dir} (packed by an earlier run)"))
    else:
        rows += pack_rows(args, paper_path, big_path, big_docs, shape)
    plan = D.load_plan(PLAN)

    mem = open_traces(paper_path, validate=False)          # validated piece by piece when packed
    base, t_mem, times = timed(analysis, mem, plan, repeat=args.repeat)
    per_doc_mem, cpu_mem = t_mem / args.paper_docs, timed.cpu / args.paper_docs
    rows += [(f"in memory, {args.paper_docs} docs: estimate+aggregate+sharp_interval+run_plan",
              f"{t_mem:.2f} s median of {[round(t, 2) for t in times]} = {per_doc_mem * 1e3:.2f} ms/doc "
              f"(data {mem.nbytes / 2**20:.0f} MiB)")]
    del mem
    t_open = time.perf_counter()
    mem_again = open_traces(paper_path, validate=False)
    t_open = time.perf_counter() - t_open
    rows.append((f"  (loading those {args.paper_docs} docs into memory, not included)", f"{t_open:.2f} s"))
    del mem_again

    lazy = open_traces(paper_path, validate=False, chunks="auto")
    with dask.config.set(scheduler="threads"):
        threads, t_threads, _ = timed(analysis_one_pass, lazy, plan)
    rows.append((f"dask, local threads (no cluster), {args.paper_docs} docs, one pass",
                 f"{t_threads:.2f} s; max |difference| vs in memory {max_diff(base, threads):.1e}"))
    with dask_client(workers=args.workers, memory_limit="4GB") as client:
        client.run(warm_up)
        n_chunks = len(lazy.chunksizes["doc"])
        same, t_lazy, _ = timed(analysis, lazy, plan)
        one, t_one, _ = timed(analysis_one_pass, lazy, plan)
        rows += [
            (f"dask, {args.workers} workers, {args.paper_docs} docs ({n_chunks} chunks): same calls",
             f"{t_lazy:.2f} s; max |difference| vs in memory {max_diff(base, same):.1e}  (target <= 1e-12)"),
            ("  same, one pass (map_docs_many)", f"{t_one:.2f} s; max |difference| {max_diff(base, one):.1e}"),
        ]
        big = open_traces(big_path, validate=False, chunks="auto")
        n_chunks = len(big.chunksizes["doc"])
        _, t_big, times = timed(analysis_one_pass, big, plan, repeat=args.big_repeat, client=client)
        cpu_big, cpu_workers = timed.cpu / big_docs, timed.cpu_workers / big_docs
        per_doc_big = t_big / big_docs
        spread = f" (median of {[round(t, 1) for t in times]})" if len(times) > 1 else ""
        rows += [(f"dask, {args.workers} workers, {big_docs} docs ({n_chunks} chunks of ~"
                  f"{big_docs // n_chunks} docs), one pass",
                  f"{t_big:.1f} s{spread} = {per_doc_big * 1e3:.2f} ms/doc = {per_doc_big / per_doc_mem:.2f}x the "
                  f"in-memory time per doc  (target <= 2x)"),
                 ("  the same against in-memory time per doc including its load",
                  f"{per_doc_big / (per_doc_mem + t_open / args.paper_docs):.2f}x"),
                 (f"  CPU time per doc, all processes: dask x{args.scale:g} / in memory",
                  f"{cpu_big * 1e3:.2f} / {cpu_mem * 1e3:.2f} ms = {cpu_big / cpu_mem:.2f}x  ({args.workers} free "
                  f"cores: wall ~ {cpu_big / cpu_mem / args.workers:.2f}x)"),
                 ("    of it in the workers / in this process (client, scheduler)",
                  f"{cpu_workers * 1e3:.2f} / {(cpu_big - cpu_workers) * 1e3:.2f} ms")]
        if not args.no_validate:
            t1 = time.perf_counter()
            validate(big)
            t_val = time.perf_counter() - t1
            rows.append((f"  validate the {big_docs} docs chunk by chunk on the cluster",
                         f"{t_val:.1f} s = {t_val / big_docs * 1e3:.2f} ms/doc"))
        if args.separate:
            _, t_sep, _ = timed(analysis, big, plan)
            rows.append(("  same, separate calls (3 passes)",
                         f"{t_sep:.1f} s = {t_sep / big_docs / per_doc_mem:.2f}x the in-memory time per doc"))
        peaks = worker_peaks(client)
        rows.append(("  peak RSS per worker", ", ".join(f"{p:.0f} MiB" for p in peaks)
                     + "  (target <= 1536 MiB)"))
    rows.append(("load average at end / wall time", f"{load()} / {time.perf_counter() - t0:.0f} s"))
    if not args.keep:
        shutil.rmtree(paper_path, ignore_errors=True)
        shutil.rmtree(big_path, ignore_errors=True)
    print()
    width = max(len(k) for k, _ in rows)
    print(f"{'benchmark':<{width}}  result")
    print("-" * (width + 60))
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
