"""Peak memory and time of `kvdiv pack` on a synthetic collection journal.

Builds a journal as `kvdiv collect` leaves it (manifest, documents, one checked
NDJSON stream per (document, policy), residual traces with random values), then
packs it in a fresh child process per mode and reports the child's peak resident
memory (``ru_maxrss``) and wall time:

- ``memory``: ``collector.pack.pack_run`` (the whole dataset in memory) +
  ``save_dataset``, the way `kvdiv pack` worked before it streamed;
- ``stream``: ``collector.pack.pack_to``, document by document (what `kvdiv pack`
  runs now), written in batches of about 4 MiB; ``stream:0`` writes each
  document on its own (the least memory), ``stream:64`` in batches of 64 MiB.

Usage: python benchmarks/bench_pack.py [--docs 200] [--policies 4] [-R 32] [-T 64] [--repeat 1]
       [--format zarr|nc] [--modes memory,stream,stream:0]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

POLICIES = ["snapkv@0.5", "snapkv#128", "recent@0.5", "snapkv@0.9", "recent@0.9", "snapkv@0.25"]
VOCAB = 32000


def _records(body: dict, model: str) -> list[dict]:
    """A valid residual stream answering ``body`` (values random, reproducible from the request)."""
    from protocols import branch_record, header_record, prompt_digest, shared_step_record

    params = body["parameters"]
    T, R, W = int(params["max_new_tokens"]), int(body["replicates"]), int(body["window"])
    key = json.dumps([body["doc_id"], body["candidate"], params["seed"]]).encode()
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(key).digest()[:8], "big"))
    prompt_ids = list(body["doc_id"].encode()) * 4
    out = [header_record(
        kind="residual", horizon=T, window=W, model=model, eos_token_id=None,
        sampling={"temperature": params["temperature"], "top_k": 0, "top_p": 1.0},
        candidate={"policy": body["candidate"], "press": "synthetic", "retention": 0.5, "budget": -1},
        seed=params["seed"], prompt_tokens=len(prompt_ids), retained_tokens=len(prompt_ids) // 2, replicates=R,
        vocab_size=VOCAB, doc=body["doc_id"], request_id="bench", prompt_sha256=prompt_digest(prompt_ids))]
    shared_tv = rng.uniform(0.01, 0.2, (R, T))
    shared_tok = rng.integers(0, VOCAB, (R, T))
    out += [shared_step_record(t + 1, shared_tv[:, t], shared_tok[:, t]) for t in range(T)]
    for r in range(R):
        t_star = int(rng.integers(1, T + 1))
        k = min(W, T - t_star)
        x = rng.integers(0, VOCAB, k + 1)
        y = (x + 1 + rng.integers(0, VOCAB - 1, k + 1)) % VOCAB
        tv = rng.uniform(0.05, 0.6, k + 1)
        tv[0] = shared_tv[r, t_star - 1]
        out.append(branch_record(r, t_star, tv, x, y))
    return out


def build_journal(run: Path, n_docs: int, policies: list[str], R: int, T: int) -> int:
    """Write a complete synthetic journal at ``run``; returns its size in bytes."""
    from collector import documents as D
    from collector.collect import CollectConfig, prepare_run, request_body
    from protocols import StreamWriter

    docs_file = D.write_jsonl([D.Document(f"doc{i:05d}", f"Synthetic document {i}.") for i in range(n_docs)],
                              run.parent / f"{run.name}-docs.jsonl")
    cfg = CollectConfig.flat(servers=["http://synthetic"], docs_file=docs_file, policies=policies, out=run,
                             kind="residual", replicates=R, max_new_tokens=T, window=T // 2, seed=1)
    journal, docs = prepare_run(cfg)
    for doc in docs:
        for policy in policies:
            w = StreamWriter()
            with journal.open_request(doc.id, policy) as req:
                for record in _records(request_body(cfg, doc, policy), "synthetic-model"):
                    req.write(w.line(record))
                req.write(w.end(T, R, 0.0))
                req.commit()
    return sum(p.stat().st_size for p in journal.requests.iterdir())


def child(mode: str, run: str, out: str) -> None:
    import collector.pack as P

    start = time.perf_counter()
    if mode == "memory":
        P.save_dataset(P.pack_run(run, progress=False), out)
    else:  # "stream" or "stream:<batch MiB>"
        batch = float(mode.split(":")[1]) if ":" in mode else 4.0
        P.pack_to(run, out, progress=False, batch_mib=batch)
    took = time.perf_counter() - start
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"mode": mode, "seconds": took, "peak_mib": peak_mib}))


def measure(mode: str, run: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True) if out.is_dir() else out.unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, __file__, "--child", mode, str(run), str(out)],
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{mode}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def baseline_mib() -> float:
    """Peak RSS of a child that only imports what packing imports (xarray, protocols, collector)."""
    code = ("import resource, collector.pack, protocols, xarray, zarr, h5netcdf;"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")
    return float(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                text=True).stdout.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=200)
    ap.add_argument("--policies", type=int, default=4)
    ap.add_argument("-R", "--replicates", type=int, default=32)
    ap.add_argument("-T", "--horizon", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--format", choices=["zarr", "nc"], default="zarr")
    ap.add_argument("--modes", default="memory,stream")
    ap.add_argument("--child", nargs=3, metavar=("MODE", "RUN", "OUT"))
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        t0 = time.perf_counter()
        size = build_journal(run, args.docs, POLICIES[:args.policies], args.replicates, args.horizon)
        print(f"journal: {args.docs} docs × {args.policies} policies, R={args.replicates}, T={args.horizon}, "
              f"W={args.horizon // 2}: {size / 2**20:.0f} MiB of NDJSON, built in {time.perf_counter() - t0:.0f} s")
        print(f"imports alone: {baseline_mib():.0f} MiB peak RSS")
        out = Path(tmp) / f"traces.{args.format}"
        rows: dict[str, list[dict]] = {}
        for _ in range(args.repeat):
            for mode in args.modes.split(","):
                rows.setdefault(mode, []).append(measure(mode, run, out))
        out_size = sum(p.stat().st_size for p in out.rglob("*")) if out.is_dir() else out.stat().st_size
        print(f"output: {out.name}, {out_size / 2**20:.0f} MiB\n")
        print(f"{'mode':<8} {'peak RSS MiB':>13} {'seconds':>8}   (median of {args.repeat})")
        first = None
        for mode, results in rows.items():
            peak = statistics.median(r["peak_mib"] for r in results)
            secs = statistics.median(r["seconds"] for r in results)
            first = first or (peak, secs)
            print(f"{mode:<8} {peak:>13.0f} {secs:>8.1f}   ×{peak / first[0]:.2f} memory, ×{secs / first[1]:.2f} time")


if __name__ == "__main__":
    main()
