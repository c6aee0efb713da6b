"""Measurement: what the coupling saves on task answers, coupled against independent P and Q runs.

Pass-key documents (``kvdiv docs --task passkey``, counted with the model's tokenizer),
``coupled`` traces sampled at ``--temperature`` with R replicates, collected twice with
different seeds (runs A and B, each with its answers decoded and scored by the collector
and ``kvdiv pack``). Per policy, the paired difference d = Q − P of the scores:

- *coupled*: Q and P from the same run (``y_A − x_A``, ``y_B − x_B``, averaged);
- *independent*: Q and P from different runs, so with different seeds per side
  (``y_B − x_A``, ``y_A − x_B``, averaged).

For each: the mean, the standard error over documents of the per-document mean, the
within-document variance over replicates, and the documents a ±5-point 95% interval
needs, (1.96 · sd / 0.05)², at this R; and ``divstats.coupling_saving``'s estimate from
run A alone. Results as JSON on stdout and in ``OUT/result.json`` (docs/measurements.md,
"What the coupling saves on pass keys").

Usage: ``python benchmarks/bench_coupling_answers.py OUT [--docs 24] [--replicates 4]
[--steps 12] [--temperature 0.5] [--target-tokens 450] [--model smollm2-135m]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import serve_in_thread  # noqa: E402

POLICIES = ("snapkv@0.5", "recent@0.5")


def _stats(d: np.ndarray) -> dict[str, float]:
    means = d.mean(axis=1)
    sd = float(means.std(ddof=1))
    return {"mean": float(means.mean()), "se_docs": sd / np.sqrt(len(means)), "sd_doc_means": sd,
            "within_var": float(d.var(axis=1, ddof=1).mean()), "docs_for_pm5": (1.96 * sd / 0.05) ** 2}


def _avg(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--docs", type=int, default=24)
    ap.add_argument("--replicates", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--temperature", type=float, default=0.5)
    ap.add_argument("--target-tokens", type=int, default=450)
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args()

    from collector import documents as D
    from collector.collect import CollectConfig, collect
    from collector.pack import pack_run
    from collector.tasks import task_documents
    from divstats import coupling_saving
    from kvdiv.demo_documents import load_tokenizer

    args.out.mkdir(parents=True, exist_ok=True)
    docs = args.out / "documents.jsonl"
    if not docs.exists():
        D.write_jsonl(task_documents("passkey", args.docs, target_tokens=args.target_tokens,
                                     tokenizer=load_tokenizer(args.model)), docs)
    url, server, _ = serve_in_thread(args.model)
    runs = {}
    try:
        for name, seed in (("A", 1), ("B", 2)):
            t0 = time.monotonic()
            result = collect(CollectConfig.flat(
                servers=[url], docs_file=docs, policies=list(POLICIES), out=args.out / name, kind="coupled",
                replicates=args.replicates, max_new_tokens=args.steps, temperature=args.temperature, seed=seed,
                template="qa", progress=False, concurrency=8))
            print(f"run {name}: {result.summary()} ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
            runs[name] = pack_run(args.out / name, progress=False)
    finally:
        server.should_exit = True
    a, b = runs["A"], runs["B"]
    out: dict = {"docs": args.docs, "replicates": args.replicates, "steps": args.steps,
                 "temperature": args.temperature, "model": args.model}
    for pol in POLICIES:
        x_a, y_a, x_b, y_b = (ds[v].sel(policy=pol).transpose("doc", "replicate").values
                              for ds, v in ((a, "x_score"), (a, "y_score"), (b, "x_score"), (b, "y_score")))
        saving = coupling_saving(x_a, y_a, margin=0.05)
        out[pol] = {
            "P_accuracy": [float(x_a.mean()), float(x_b.mean())], "Q_accuracy": [float(y_a.mean()), float(y_b.mean())],
            "coupled": _avg([_stats(y_a - x_a), _stats(y_b - x_b)]),
            "independent": _avg([_stats(y_b - x_a), _stats(y_a - x_b)]),
            "divstats_coupling_saving_run_A": {k: getattr(saving, k) for k in (
                "within_coupled", "within_independent", "covariance", "docs_needed_coupled",
                "docs_needed_independent")},
            "docs_where_P_varies": int((x_a.std(axis=1) > 0).sum()),
            "docs_where_Q_varies": int((y_a.std(axis=1) > 0).sum()),
        }
    text = json.dumps(out, indent=1, default=float)
    (args.out / "result.json").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
