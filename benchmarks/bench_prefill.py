"""Benchmark: one prefill per document — a grouped request's time against its one-candidate request.

One chat prompt of about ``--prompt-tokens`` tokens (benchmarks/common.py), whole
requests through ``Engine.trace`` (prefill, decoding, branches, records; no HTTP). Per
repeat, alternately in this one process (the order flips every repeat):

- ``1 candidate``: a grouped request with the first policy alone;
- ``C candidates``: the same request with every policy (the full control included),
  P's prompt prefilled once (``Engine.shared_prefill``, the default);
- ``C candidates, prefill each`` (unless ``--no-before``): the same request with one
  prefill per candidate, the engine before one prefill per document.

The table gives each repeat's seconds, the medians and each mode's median ratio to the
one-candidate request, and checks that both grouped modes stream the same records
(tokens and TVs bit for bit).

Usage: ``python benchmarks/bench_prefill.py [--prompt-tokens 3400] [--rows 4] [--steps 4]
[--kind residual] [--policies snapkv@0.5 recent@0.5 snapkv@0.9 full] [--repeats 2] [--fuse off]
[--no-before] [--model embedded]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import statistics  # noqa: E402
from typing import Any  # noqa: E402

from common import chat_prompt_ids, clock  # noqa: E402

from gen_service.engine.facade import Engine  # noqa: E402
from gen_service.engine.jobs import (
    Sampling,  # noqa: E402
    TraceJob,  # noqa: E402
)
from gen_service.models.loading import load_model  # noqa: E402


def run(engine: Engine, ids: list[int], policies: list[str], args: argparse.Namespace,
        shared: bool) -> tuple[float, list[Any]]:
    """Seconds of one grouped request, and its items."""
    job = TraceJob(prompt_ids=ids, kind=args.kind, horizon=args.steps, replicates=args.rows, sampling=Sampling(),
                   candidate="", candidates=policies, seeds=list(range(1, len(policies) + 1)), request_id="bench")
    engine.shared_prefill = shared
    t0 = clock(engine.device)
    items = list(engine.trace(job))
    return clock(engine.device) - t0, items


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--prompt-tokens", type=int, default=3400, help="prose tokens (the chat template adds a few)")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--kind", default="residual", choices=["coupled", "residual", "reference"])
    ap.add_argument("--policies", nargs="+", default=["snapkv@0.5", "recent@0.5", "snapkv@0.9", "full"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--fuse", default="off", choices=["auto", "on", "off"], help="Engine.fuse, every mode")
    ap.add_argument("--no-before", action="store_true", help="skip the grouped request with a prefill per candidate")
    args = ap.parse_args()

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    engine = Engine(load_model(args.model))
    engine.fuse = args.fuse
    ids = chat_prompt_ids(engine.lm.tokenizer, args.prompt_tokens)
    C = len(args.policies)
    modes = {"1 candidate": (args.policies[:1], True), f"{C} candidates": (args.policies, True)}
    if not args.no_before:
        modes[f"{C} candidates, prefill each"] = (args.policies, False)
    print(f"{args.model} on {engine.device.type}: {len(ids)}-token prompt, {args.kind}, R={args.rows}, "
          f"T={args.steps}, policies {', '.join(args.policies)}, fuse {args.fuse}, {args.repeats} repeats")
    times: dict[str, list[float]] = {m: [] for m in modes}
    same = True
    for rep in range(args.repeats):
        order = list(modes) if rep % 2 == 0 else list(modes)[::-1]
        items = {}
        for mode in order:
            policies, shared = modes[mode]
            seconds, items[mode] = run(engine, ids, policies, args, shared)
            times[mode].append(seconds)
            print(f"  repeat {rep + 1}, {mode}: {seconds:.1f} s", flush=True)
        if not args.no_before:
            same &= items[f"{C} candidates"] == items[f"{C} candidates, prefill each"]
    base = statistics.median(times["1 candidate"])
    print("\n| request | per repeat (s) | median s | ÷ 1 candidate |\n|---|---|---|---|")
    for mode, ts in times.items():
        med = statistics.median(ts)
        print(f"| {mode} | {', '.join(f'{t:.1f}' for t in ts)} | {med:.1f} | **{med / base:.2f}** |")
    if not args.no_before:
        print(f"\nthe two grouped requests streamed the same records bit for bit: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
