"""Benchmark: continuous batching across requests (``kvdiv serve --max-batch-requests``).

A collection as ``kvdiv demo`` runs it, through HTTP on a loopback port: pydoc
documents of ~128 tokens in the ``summarise`` chat template (its raw form for a base model), the demo's four policies
(``snapkv@0.5``, ``snapkv#N`` with N half the median prompt, ``recent@0.5``,
``snapkv@0.9``) and the full control, one request per document holding the five as
candidates (``--group-candidates``, the default), residual traces with R = 4, T = 8,
W = 7, ``--concurrency`` requests in flight. Two servers in this one process, built by
``build_service`` with the same settings but ``max_batch_requests``:

- ``batched``: the default (``--batch`` requests decoded in one batch);
- ``one at a time``: ``--max-batch-requests 1``, each request alone on the model thread.

Each repeat runs ``collect`` into a fresh journal against each server, alternately (which
goes first swaps every repeat). The table gives each repeat's wall time, the medians
and the median of the per-repeat ratios; the packed traces of the two servers are
compared (tokens equal per (document, policy, replicate, step), the share of equal
token arrays, largest |ΔTV|).

Usage: ``python benchmarks/bench_batching.py [--docs 8] [--repeats 3] [--rows 4]
[--steps 8] [--batch 8] [--concurrency 8] [--model embedded]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
from common import serve_in_thread  # noqa: E402

from collector import documents as D  # noqa: E402
from collector.collect import CollectConfig, collect  # noqa: E402
from collector.pack import pack_run  # noqa: E402


def message(m: dict[str, str]) -> Any:
    from gen_service.serving.intake import Message

    return Message(role=m["role"], content=m["content"])


def compare(a: Any, b: Any) -> tuple[float, int, float]:
    """(share of drawn tokens equal, tokens compared, largest |ΔTV|) of two packs of the same
    collection: every token variable, where either pack drew one (-1: none)."""
    equal = total = 0
    worst = 0.0
    for var in a.data_vars:
        x, y = a[var], b[var].transpose(*a[var].dims)
        if var.endswith("token"):
            drawn = (x.values >= 0) | (y.values >= 0)
            equal += int((x.values == y.values)[drawn].sum())
            total += int(drawn.sum())
        elif var.endswith("tv"):
            diff = np.abs(x.values - y.values)
            if np.isfinite(diff).any():
                worst = max(worst, float(np.nanmax(diff)))
    return equal / max(total, 1), total, worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8, help="the batched server's --max-batch-requests")
    ap.add_argument("--concurrency", type=int, default=8, help="collect's requests in flight (both servers)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    t_start = time.perf_counter()
    servers = {"batched": serve_in_thread(args.model, max_batch_requests=args.batch),
               "one at a time": serve_in_thread(args.model, max_batch_requests=1)}
    service = servers["batched"][2]
    tok = service.engine.lm.tokenizer
    docs = D.select(D.pydoc_documents(tok, target_tokens=128), args.docs)
    tmp = Path(tempfile.mkdtemp(prefix="bench_batching-"))
    docs_file = D.write_jsonl(docs, tmp / "docs.jsonl")
    # a base model (no chat template, e.g. gemma3-270m) reads the raw form, as in the demo
    template = "summarise" if getattr(tok, "chat_template", None) else "summarise" + D.RAW_SUFFIX
    if template == "summarise":
        lengths = [len(service.encode_chat(tuple(message(m) for m in D.render_messages(d, template)))) for d in docs]
    else:
        lengths = [len(tok.encode("".join(D.prompt_fields(d, template).values()))) for d in docs]
    policies = ["snapkv@0.5", f"snapkv#{max(1, round(statistics.median(lengths) / 2))}", "recent@0.5", "snapkv@0.9"]
    print(f"{args.model} through HTTP: {len(docs)} documents ({min(lengths)}-{max(lengths)} prompt tokens), "
          f"policies {', '.join(policies)} + the control full, one request per document; residual, "
          f"R={args.rows}, T={args.steps}, W={args.steps - 1}; collect --concurrency {args.concurrency}; "
          f"batched server --max-batch-requests {args.batch}; {args.repeats} repeats", flush=True)
    modes = list(servers)
    totals: dict[str, list[float]] = {m: [] for m in modes}
    for rep in range(args.repeats):
        for mode in modes if rep % 2 == 0 else modes[::-1]:
            cfg = CollectConfig.flat(servers=[servers[mode][0]], docs_file=docs_file, policies=policies,
                                     out=tmp / f"{rep}-{mode.replace(' ', '_')}", kind="residual",
                                     replicates=args.rows, max_new_tokens=args.steps, window=args.steps - 1,
                                     seed=args.seed, progress=False, concurrency=args.concurrency, control=True,
                                     template=template)
            t0 = time.perf_counter()
            result = collect(cfg)
            totals[mode].append(time.perf_counter() - t0)
            assert result.ok, result.summary()
        print(f"  repeat {rep + 1}: " + ", ".join(f"{m} {totals[m][-1]:.1f} s" for m in modes), flush=True)
    base = modes[1]
    print(f"\n| server | per repeat (s) | median s | speed-up vs {base} |\n|---|---|---|---|")
    for mode in modes:
        med = statistics.median(totals[mode])
        print(f"| {mode} | {', '.join(f'{t:.1f}' for t in totals[mode])} | {med:.1f} | "
              f"{statistics.median(totals[base]) / med:.2f} |")
    ratios = [b / a for a, b in zip(totals[modes[0]], totals[base], strict=True)]
    print(f"\nper-repeat speed-up ({base} ÷ batched): {', '.join(f'{r:.2f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.2f}")
    packs = [pack_run(tmp / f"0-{m.replace(' ', '_')}", progress=False) for m in modes]
    share, total, worst = compare(*packs)
    print(f"packed traces (repeat 1): same tokens {100 * share:.2f}% of {total}, max |ΔTV| {worst:.1e}")
    print(f"benchmark took {time.perf_counter() - t_start:.0f} s")
    for _, server, _ in servers.values():
        server.should_exit = True


if __name__ == "__main__":
    main()
