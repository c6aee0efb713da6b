"""Benchmark: a document's policies as the candidates of one request vs one request per policy.

The demo's collection shape (kvdiv/demo_spec.py): pydoc documents of ~128 tokens in the
``summarise`` chat template, the demo's four policies (``snapkv@0.5``, ``snapkv#N``
with N half the median prompt, ``recent@0.5``, ``snapkv@0.9``), residual traces with
R = 8, T = 10, W = 9, each request's seed derived from (seed, document, policy) as the
collector derives it. For every repeat and document, alternately in this one process:

- ``separate``: one request per policy (``Engine.trace``, one candidate each);
- ``grouped``: one request holding the four policies as candidates, forwards stacked
  (``Engine.batch_candidates``, the default);
- ``grouped, alone`` (with ``--alone``): the same request with every forward alone,
  which isolates what stacking the forwards buys.

Whole requests are timed (prefills, decoding, branches, records), without HTTP. The
table gives each repeat's total over the documents, the median ratio, and whether the
grouped traces agree with the separate ones (same tokens; largest |ΔTV|).

With ``--collect`` the same shape runs end to end instead: ``kvdiv serve``'s app on a
loopback port (``--fuse`` is the server's setting) and ``collector.collect`` over the
documents into a fresh journal, with ``group_candidates`` on and off alternately; the
packed traces of both are compared.

Usage: ``python benchmarks/bench_candidates.py [--docs 4] [--repeats 3] [--model embedded]
[--kind residual] [--rows 8] [--steps 10] [--window 9] [--alone] [--fuse off|auto|on]
[--baseline-fuse off|auto|on] [--collect]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from common import serve_in_thread  # noqa: E402

from collector import documents as D  # noqa: E402
from collector.checks import derive_seed  # noqa: E402
from gen_service.engine.coupling import Sampling  # noqa: E402
from gen_service.engine.facade import Engine  # noqa: E402
from gen_service.engine.jobs import CandidateDone, CandidateFailed, TraceJob  # noqa: E402
from gen_service.models.loading import load_model  # noqa: E402


def demo_prompts(engine: Engine, count: int) -> list[tuple[str, list[int]]]:
    """(doc id, prompt ids) of ``count`` demo-like documents, as the server tokenises them."""
    tok = engine.lm.tokenizer
    docs = D.select(D.pydoc_documents(tok, target_tokens=128), count)
    out = []
    for doc in docs:
        ids = tok.apply_chat_template(D.render_messages(doc, "summarise"), tokenize=True, add_generation_prompt=True)
        out.append((doc.id, list(ids if isinstance(ids, list) else ids["input_ids"])))
    return out


def _job(ids: list[int], args: argparse.Namespace, **kw: Any) -> TraceJob:
    return TraceJob(prompt_ids=ids, kind=args.kind, horizon=args.steps, replicates=args.rows,
                    window=args.window if args.kind == "residual" else None, sampling=Sampling(), **kw)


def separate(engine: Engine, ids: list[int], policies: list[str], seeds: list[int],
             args: argparse.Namespace) -> tuple[float, dict[str, list[dict]]]:
    t0 = time.perf_counter()
    out = {p: list(engine.trace(_job(ids, args, candidate=p, seed=s))) for p, s in zip(policies, seeds, strict=True)}
    return time.perf_counter() - t0, out


def grouped(engine: Engine, ids: list[int], policies: list[str], seeds: list[int],
            args: argparse.Namespace) -> tuple[float, dict[str, list[dict]]]:
    t0 = time.perf_counter()
    items = list(engine.trace(_job(ids, args, candidate="", candidates=policies, seeds=seeds)))
    elapsed = time.perf_counter() - t0
    out: dict[str, list[dict]] = {p: [] for p in policies}
    for item in items:
        if isinstance(item, CandidateFailed):
            raise RuntimeError(f"{item.policy} failed: {item.error}")
        if isinstance(item, CandidateDone):
            continue
        rec = dict(item)
        policy = rec["candidate"]["policy"] if rec["type"] == "header" else rec.pop("candidate")
        out[policy].append(rec)
    return elapsed, out


def agreement(a: dict[str, list[dict]], b: dict[str, list[dict]]) -> tuple[bool, float]:
    """(same tokens everywhere, largest |ΔTV|) between two runs' records."""
    same, worst = True, 0.0
    for policy, recs in a.items():
        for ra, rb in zip(recs[1:], b[policy][1:], strict=True):
            for key in ra:
                if key == "tv":
                    worst = max([worst] + [abs(x - y) for x, y in zip(ra[key], rb[key], strict=True)
                                           if x is not None and y is not None])
                elif ra[key] != rb[key]:
                    same = False
    return same, worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kind", default="residual", choices=["coupled", "residual"])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--window", type=int, default=9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--alone", action="store_true", help="also time the grouped request with every forward alone")
    ap.add_argument("--fuse", default="off", choices=["auto", "on", "off"],
                    help="P's and Q's forwards as one (Engine.fuse), for both modes; off isolates the candidates")
    ap.add_argument("--baseline-fuse", default=None, choices=["auto", "on", "off"],
                    help="Engine.fuse for the separate requests only (default: --fuse); "
                         "--fuse auto --baseline-fuse off compares with the engine before fusion")
    ap.add_argument("--collect", action="store_true",
                    help="end to end: a loopback server and `collect` with --group-candidates on and off")
    args = ap.parse_args()
    if args.collect:
        bench_collect(args)
        return

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    t_start = time.perf_counter()
    engine = Engine(load_model(args.model))
    baseline_fuse = args.baseline_fuse or args.fuse
    prompts = demo_prompts(engine, args.docs)
    budget = max(1, round(statistics.median(len(ids) for _, ids in prompts) / 2))
    policies = ["snapkv@0.5", f"snapkv#{budget}", "recent@0.5", "snapkv@0.9"]
    print(f"{args.model}: {len(prompts)} documents ({min(len(i) for _, i in prompts)}-"
          f"{max(len(i) for _, i in prompts)} prompt tokens), policies {', '.join(policies)}; "
          f"{args.kind}, R={args.rows}, T={args.steps}, W={args.window}, {args.repeats} repeats, fuse {args.fuse} "
          f"(separate requests: {baseline_fuse})")
    modes = ["separate", "grouped"] + (["grouped, alone"] if args.alone else [])
    totals: dict[str, list[float]] = {m: [] for m in modes}
    same, worst = True, 0.0
    for rep in range(args.repeats):
        spent = dict.fromkeys(modes, 0.0)
        for doc_id, ids in prompts:
            seeds = [derive_seed(args.seed, doc_id, p) for p in policies]
            order = modes if rep % 2 == 0 else modes[::-1]   # alternate which runs first
            records = {}
            for mode in order:
                engine.batch_candidates = mode != "grouped, alone"
                engine.fuse = baseline_fuse if mode == "separate" else args.fuse
                run = separate if mode == "separate" else grouped
                sec, records[mode] = run(engine, ids, policies, seeds, args)
                spent[mode] += sec
            ok, dtv = agreement(records["grouped"], records["separate"])
            same, worst = same and ok, max(worst, dtv)
        for mode in modes:
            totals[mode].append(spent[mode])
        print(f"  repeat {rep + 1}: " + ", ".join(f"{m} {spent[m]:.1f} s" for m in modes), flush=True)
    base = statistics.median(totals["separate"])
    print(f"\n| mode | median s ({len(prompts)} docs × {len(policies)} policies) | speed-up vs separate |")
    print("|---|---|---|")
    for mode in modes:
        med = statistics.median(totals[mode])
        print(f"| {mode} | {med:.1f} | {base / med:.2f} |")
    ratios = [s / g for s, g in zip(totals["separate"], totals["grouped"], strict=True)]
    print(f"\nper-repeat speed-up (separate ÷ grouped): {', '.join(f'{r:.2f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.2f}")
    print(f"grouped vs separate: same tokens {same}, max |ΔTV| {worst:.1e}")
    print(f"benchmark took {time.perf_counter() - t_start:.0f} s")


SHORT = {"one request per policy": "separate", "one request per document": "grouped"}


def bench_collect(args: argparse.Namespace) -> None:
    """``--collect``: the demo's collection through HTTP, grouped and not, alternately."""
    import tempfile
    from pathlib import Path

    import numpy as np

    from collector.collect import CollectConfig, collect
    from collector.pack import pack_run

    t_start = time.perf_counter()
    url, server, service = serve_in_thread(args.model, fuse=args.fuse)
    tok = service.engine.lm.tokenizer
    docs = D.select(D.pydoc_documents(tok, target_tokens=128), args.docs)
    tmp = Path(tempfile.mkdtemp(prefix="bench_candidates-"))
    docs_file = D.write_jsonl(docs, tmp / "docs.jsonl")
    lengths = [len(service.encode_chat(tuple(service_message(m) for m in D.render_messages(d, "summarise"))))
               for d in docs]
    policies = ["snapkv@0.5", f"snapkv#{max(1, round(statistics.median(lengths) / 2))}", "recent@0.5", "snapkv@0.9"]
    print(f"{args.model} through HTTP: {len(docs)} documents ({min(lengths)}-{max(lengths)} prompt tokens), "
          f"policies {', '.join(policies)}; {args.kind}, R={args.rows}, T={args.steps}, W={args.window}, "
          f"{args.repeats} repeats, server --fuse {args.fuse}")
    modes = ["one request per policy", "one request per document"]
    totals: dict[str, list[float]] = {m: [] for m in modes}
    for rep in range(args.repeats):
        for mode in modes if rep % 2 == 0 else modes[::-1]:
            cfg = CollectConfig.flat(servers=[url], docs_file=docs_file, policies=policies,
                                     out=tmp / f"{rep}-{SHORT[mode]}",
                                     kind=args.kind, replicates=args.rows, max_new_tokens=args.steps,
                                     window=args.window if args.kind == "residual" else None, seed=args.seed,
                                     progress=False, group_candidates=mode.endswith("document"))
            t0 = time.perf_counter()
            result = collect(cfg)
            totals[mode].append(time.perf_counter() - t0)
            assert result.ok, result.summary()
        print(f"  repeat {rep + 1}: " + ", ".join(f"{m} {totals[m][-1]:.1f} s" for m in modes), flush=True)
    a, b = (pack_run(tmp / f"0-{SHORT[m]}", progress=False) for m in modes)
    same = all((a[v].values == b[v].values).all() for v in a.data_vars if v.endswith("token"))
    worst = max(float(np.nanmax(np.abs(a[v].values - b[v].values))) for v in a.data_vars if v.endswith("tv"))
    ratios = [s / g for s, g in zip(totals[modes[0]], totals[modes[1]], strict=True)]
    print("\n| collection | median s | speed-up |\n|---|---|---|")
    for mode in modes:
        med = statistics.median(totals[mode])
        print(f"| {mode} | {med:.1f} | {statistics.median(totals[modes[0]]) / med:.2f} |")
    print(f"\nper-repeat speed-up: {', '.join(f'{r:.2f}' for r in ratios)}; median {statistics.median(ratios):.2f}")
    print(f"packed traces: same tokens {same}, max |ΔTV| {worst:.1e}; fused-forward choices "
          f"{service.engine.fusion_info()['measured']}")
    print(f"benchmark took {time.perf_counter() - t_start:.0f} s")
    server.should_exit = True


def service_message(message: dict[str, str]) -> Any:
    from gen_service.serving.service import Message

    return Message(role=message["role"], content=message["content"])


if __name__ == "__main__":
    main()
