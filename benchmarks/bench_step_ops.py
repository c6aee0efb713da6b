"""Torch ops per decoding step of a Llama-3.1-8B-shaped random model, from the profiler.

One grouped coupled request (4 candidates + the ``full`` control, R rows each) on
``random:llama-8b``'s shapes (hidden 4096, 32 query / 8 KV heads, MLP 14336, the
128,256-token vocabulary) in bfloat16 on the CPU, with ``--layers`` decoder layers and
the head tied to the embedding so it fits in a few GB. The request runs twice, at
``T1`` and ``T2`` steps, under ``torch.profiler``; the ops per decoding step are the
difference divided by ``T2 - T1`` (prefill and headers cancel). Two counts: every
``aten::`` call (nested calls included, as bench_engine_ops.py counts) and the leaf
``aten::`` calls (no ``aten::`` call inside: what would be a kernel launch on a GPU).

The script imports only what both layouts of gen_service have (before and after the
rooms reorganisation), so it measures any checkout: run it with that checkout on
``PYTHONPATH``. Usage: ``python benchmarks/bench_step_ops.py [--layers 1] [--rows 4]
[--prompt-tokens 128] [--fuse off]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

from torch.profiler import ProfilerActivity, profile  # noqa: E402

from gen_service.engine.facade import Engine  # noqa: E402
from gen_service.engine.jobs import TraceJob  # noqa: E402

try:                                   # the rooms layout (gen_service/models/, gen_service/engine/coupling)
    import gen_service.models.loading as loading
    from gen_service.engine.jobs import Sampling
except ImportError:                    # before it
    import gen_service.models as loading  # type: ignore[no-redef]
    from gen_service.coupling import Sampling  # type: ignore[no-redef]

CANDIDATES = ["snapkv@0.5", "recent@0.5", "snapkv@0.9", "recent@0.3", "full"]


def count(engine: Engine, job: TraceJob) -> tuple[int, int]:
    """(all aten calls, leaf aten calls) of one whole request."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in engine.trace(job):
            pass
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    leaves = [e for e in events if not any(c.name.startswith("aten::") for c in e.cpu_children)]
    return len(events), len(leaves)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--fuse", default="off", choices=["off", "on"])
    ap.add_argument("--steps", type=int, nargs=2, default=(3, 7), metavar=("T1", "T2"))
    args = ap.parse_args()
    loading.RANDOM_CONFIGS["random:llama-8b"] = {**loading.RANDOM_CONFIGS["random:llama-8b"],
                                                 "num_hidden_layers": args.layers, "tie_word_embeddings": True}
    lm = loading.load_model("random:llama-8b", device="cpu", dtype="bfloat16")
    engine = Engine(lm)
    engine.fuse = args.fuse
    ids = [(7 * i) % 40000 + 10 for i in range(args.prompt_tokens)]

    def job(steps: int) -> TraceJob:
        return TraceJob(prompt_ids=ids, candidate="", candidates=CANDIDATES, seeds=list(range(len(CANDIDATES))),
                        horizon=steps, replicates=args.rows, sampling=Sampling(), request_id="ops")

    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=os.path.dirname(loading.__file__)).stdout.strip()
    for _ in engine.trace(job(2)):      # warm-up (lazy imports, the float32 head)
        pass
    t0 = time.perf_counter()
    (a1, l1), (a2, l2) = count(engine, job(args.steps[0])), count(engine, job(args.steps[1]))
    dt = args.steps[1] - args.steps[0]
    print(f"| {rev} | {args.layers} | {args.rows} × {len(CANDIDATES)} | fuse {args.fuse} | "
          f"{(a2 - a1) / dt:.0f} | {(l2 - l1) / dt:.0f} | {time.perf_counter() - t0:.0f} s |")


if __name__ == "__main__":
    main()
