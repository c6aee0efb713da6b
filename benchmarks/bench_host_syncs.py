"""Host synchronisations per decoding step of the engine's loops.

Counts the host reads of tensors (``item``, ``tolist``, ``bool`` ... :data:`HOST_READS`;
each one a wait for the queued kernels on a GPU) made by ``gen_service``'s code while
a request decodes (after its headers: prefill excluded), for coupled and residual
requests and a 4-candidate request, and prints them per decoding step.

The counter is loaded from this tree's ``gen_service/engine/readback.py`` by path, so
the same script measures another tree's engine: put that tree first on
``PYTHONPATH`` (the table names the ``gen_service`` it measured), e.g. a checkout of
the commit before the readback.

Usage: ``python benchmarks/bench_host_syncs.py [--model tiny:llama] [--rows 8] [--steps 16]``.
"""

from __future__ import annotations

import os

# before torch loads OpenMP (see gen_service/api/cli.py)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import importlib.util  # noqa: E402
from pathlib import Path  # noqa: E402

import gen_service  # noqa: E402
from gen_service.engine.facade import Engine  # noqa: E402
from gen_service.engine.jobs import (
    Sampling,  # noqa: E402
    TraceJob,  # noqa: E402
)
from gen_service.models.loading import load_model  # noqa: E402

_READBACK = Path(__file__).resolve().parents[1] / "gen_service" / "engine" / "readback.py"


def _counter() -> type:
    spec = importlib.util.spec_from_file_location("_bench_readback", _READBACK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.HostReads


def decoding_reads(engine: Engine, job: TraceJob, headers: int) -> tuple[int, dict[str, int]]:
    """Host reads by gen_service's code after the first ``headers`` records."""
    HostReads = _counter()
    stream = engine.trace(job)
    for _ in range(headers):
        next(stream)
    with HostReads([os.path.dirname(gen_service.__file__)]) as reads:
        for _ in stream:
            pass
    return reads.count, reads.by_site


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny:llama")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--sites", action="store_true", help="print where the reads are made")
    args = ap.parse_args()
    engine = Engine(load_model(args.model))
    engine.fuse = "off"   # the fused-forward measurement times (and reads) its first step
    ids = list(range(10, 140))
    base = dict(prompt_ids=ids, horizon=args.steps, replicates=args.rows, seed=3, sampling=Sampling())
    cases = [("coupled, 1 candidate", TraceJob(candidate="snapkv@0.5", kind="coupled", **base), 1),
             ("residual, 1 candidate", TraceJob(candidate="snapkv@0.5", kind="residual", **base), 1),
             ("coupled, 4 candidates", TraceJob(candidate="", kind="coupled", **base,
                                                candidates=["snapkv@0.5", "snapkv#40", "recent@0.5", "snapkv@0.9"]),
              4)]
    print(f"gen_service measured: {os.path.dirname(gen_service.__file__)}")
    print(f"model {args.model}, R = {args.rows}, T = {args.steps}, readback every "
          f"{getattr(engine, 'readback_every', 1)} steps\n")
    print("| request | host reads while decoding | per step |\n|---|---|---|")
    for name, job, headers in cases:
        count, sites = decoding_reads(engine, job, headers)
        print(f"| {name} | {count} | {count / args.steps:.2f} |")
        if args.sites:
            for site, n in sorted(sites.items(), key=lambda kv: -kv[1]):
                print(f"|   {site} | {n} | |")


if __name__ == "__main__":
    main()
