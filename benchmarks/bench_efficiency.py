"""Precision per compute second: residual-branch vs crude (coupled) estimators on the embedded model.

For each policy and estimand, on the same documents with the same seeds in one run:

* variance per replicate ``v``: the Monte Carlo variance of one replicate's
  influence value (``divstats.estimation.components.replicate_influence``; for the branch-TV
  windows R times the squared delta-method SE of ``divstats.branch_tv_window``),
  averaged over documents;
* seconds per replicate ``s``: wall time of the request (prefill included) / R,
  the engine run in-process (no HTTP), median over documents;
* efficiency ``1 / (v s)``; the table shows residual / crude with a 95% bootstrap
  interval (documents and replicates resampled; the timing is held fixed and its
  own spread is printed).

With ``--crn`` it also measures common random numbers: residual traces collected
again with one seed per document shared by the policies (``kvdiv collect
--common-random-numbers``), and the per-replicate variance of the paired
differences with vs without, with a bootstrap interval.

Usage: python benchmarks/bench_efficiency.py [--docs 4] [-R 16] [-T 10] [--crn]
       [--policies snapkv@0.9,snapkv@0.5,recent@0.5] [--target-tokens 128]
Takes a few minutes on 2 CPU cores at the defaults.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

import argparse  # noqa: E402
import hashlib  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from itertools import combinations  # noqa: E402

import numpy as np  # noqa: E402
import xarray as xr  # noqa: E402

import divstats  # noqa: E402
from collector import documents as D  # noqa: E402
from divstats.estimation.components import replicate_influence  # noqa: E402
from gen_service.engine.facade import Engine  # noqa: E402
from gen_service.engine.jobs import TraceJob  # noqa: E402
from gen_service.models.loading import load_model  # noqa: E402
from gen_service.presses.registry import PolicyRegistry  # noqa: E402
from protocols import StreamWriter, assemble  # noqa: E402

METRICS = ("loss", "occurrence", "exposure", "rate")
N_BOOT = 400


def seed_for(seed: int, doc: str, policy: str | None, kind: str) -> int:
    key = f"bench:{seed}\0{doc}" + ("" if policy is None else f"\0{policy}") + f"\0{kind}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") & 0x7FFFFFFF


def prompts(engine: Engine, n_docs: int, target_tokens: int) -> list[tuple[str, list[int]]]:
    tok = engine.lm.tokenizer
    docs = D.pydoc_documents(tok, target_tokens=target_tokens)
    step = max(1, len(docs) // n_docs)
    out = []
    for doc in docs[::step][:n_docs]:
        messages = D.render_messages(doc, "summarise")
        if getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        else:  # the tiny test models' byte tokenizer has no chat template
            ids = tok(messages[0]["content"]).input_ids
        out.append((doc.id, list(ids if isinstance(ids, list) else ids["input_ids"])))
    return out


def collect(engine: Engine, docs, policies, kind: str, T: int, R: int, seed: int, common: bool):
    """(dataset over doc x policy, seconds per request array (doc, policy))."""
    rows, secs = [], np.zeros((len(docs), len(policies)))
    for i, (doc, ids) in enumerate(docs):
        parts = []
        for j, pol in enumerate(policies):
            job = TraceJob(prompt_ids=ids, candidate=pol, kind=kind, horizon=T, replicates=R,
                           window=T - 1 if kind == "residual" else None, doc=doc,
                           seed=seed_for(seed, doc, None if common else pol, "shared" if common else kind))
            w = StreamWriter()
            t0 = time.perf_counter()
            lines = [w.line(r) for r in engine.trace(job)]
            secs[i, j] = time.perf_counter() - t0
            parts.append(assemble([*lines, w.end(T, R, secs[i, j])]))
        rows.append(xr.concat(parts, dim="policy", coords="different", compat="equals", join="outer"))
    return xr.concat(rows, dim="doc", coords="different", compat="equals", join="outer"), secs


def window_influence(ds: xr.Dataset, first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
    """(per-doc estimate, per-replicate variance) of the branch-TV window mean, (doc, policy)."""
    res = divstats.branch_tv_window(ds, first, last + 1)
    R = ds.sizes["replicate"]
    return res["branch_tv_window"].values, (res["branch_tv_window_se"] ** 2 * R).values


def per_replicate_var(infl: np.ndarray) -> np.ndarray:
    """(doc, policy, replicate) influence values -> per-replicate variance (doc, policy)."""
    return np.nanvar(infl, axis=-1, ddof=1)


def bootstrap_ratio(num: np.ndarray, den: np.ndarray, rng: np.random.Generator) -> tuple[float, float, float]:
    """Ratio of the doc-mean per-replicate variances, num / den, with a 95% bootstrap interval.

    num, den: (doc, replicate) influence values of one policy (den: crude, num: residual,
    or the paired differences with / without CRN).  Documents, then replicates within
    each, are resampled.
    """
    point = np.nanmean(per_replicate_var(num[:, None])) / np.nanmean(per_replicate_var(den[:, None]))
    n_doc, n_rep = num.shape
    out = []
    for _ in range(N_BOOT):
        d = rng.integers(0, n_doc, n_doc)
        rn, rd = rng.integers(0, n_rep, (n_doc, n_rep)), rng.integers(0, n_rep, (n_doc, n_rep))
        vn = np.nanmean(np.nanvar(num[d[:, None], rn], axis=-1, ddof=1))
        vd = np.nanmean(np.nanvar(den[d[:, None], rd], axis=-1, ddof=1))
        out.append(vn / vd if vd > 0 else np.nan)
    lo, hi = np.nanquantile(out, [0.025, 0.975])
    return float(point), float(lo), float(hi)


def efficiency_table(crude: xr.Dataset, resid: xr.Dataset, secs_c: np.ndarray, secs_r: np.ndarray,
                     policies: list[str], T: int, R: int, rng: np.random.Generator) -> None:
    ic, ir = replicate_influence(crude), replicate_influence(resid)
    s_c, s_r = np.median(secs_c, axis=0) / R, np.median(secs_r, axis=0) / R
    print(f"\n## Efficiency residual / crude = (v_crude s_crude) / (v_resid s_resid); {crude.sizes['doc']} docs, "
          f"R = {R}, T = {T}, W = {T - 1}")
    print(f"{'policy':<12}{'estimand':<16}{'v_crude':>10}{'v_resid':>10}{'var ratio c/r':>15}{'s_c':>7}{'s_r':>7}"
          f"{'efficiency r/c':>16}  95% interval")
    windows = {"branch_tv_early": (1, max(1, (T - 1) // 4)), "branch_tv_late": (max(2, (T - 1) // 2), T - 1)}
    for j, pol in enumerate(policies):
        for name in (*METRICS, *windows):
            if name in windows:
                vc = window_influence(crude, *windows[name])[1][:, j]
                vr = window_influence(resid, *windows[name])[1][:, j]
                ratio = np.nanmean(vc) / np.nanmean(vr)
                lo = hi = np.nan  # the window SE is a delta-method summary: no replicate-level bootstrap here
            else:
                c, r = (x[name].transpose("doc", "policy", "replicate").values[:, j] for x in (ic, ir))
                vc, vr = per_replicate_var(c[:, None])[:, 0], per_replicate_var(r[:, None])[:, 0]
                ratio, lo, hi = bootstrap_ratio(c, r, rng)
            eff = ratio * s_c[j] / s_r[j]
            interval = f"[{lo * s_c[j] / s_r[j]:.2f}, {hi * s_c[j] / s_r[j]:.2f}]" if np.isfinite(lo) else "n/a"
            print(f"{pol:<12}{name:<16}{np.nanmean(vc):>10.4g}{np.nanmean(vr):>10.4g}{ratio:>15.2f}"
                  f"{s_c[j]:>7.3f}{s_r[j]:>7.3f}{eff:>16.2f}  {interval}")
    spread = [statistics.pstdev(list(secs_r[:, j] / secs_c[:, j])) for j in range(len(policies))]
    print("seconds per replicate: median over documents; spread (SD) of the per-document time ratio r/c: "
          + ", ".join(f"{p} {s:.2f}" for p, s in zip(policies, spread, strict=True)))


def pair_difference(infl: xr.Dataset, name: str, a: str, b: str) -> np.ndarray:
    """(doc, replicate) influence values of policy a minus policy b, replicates paired by index."""
    return (infl[name].sel(policy=a) - infl[name].sel(policy=b)).transpose("doc", "replicate").values


def crn_table(indep: xr.Dataset, shared: xr.Dataset, policies: list[str], rng: np.random.Generator) -> None:
    ii, ish = replicate_influence(indep), replicate_influence(shared)
    print("\n## Common random numbers: per-replicate variance of paired differences, shared / independent seeds")
    print(f"{'pair':<28}{'estimand':<12}{'v_indep':>10}{'v_crn':>10}{'crn / indep':>13}  95% interval")
    for a, b in combinations(policies, 2):
        for name in ("loss", "occurrence", "exposure"):
            d_ind, d_crn = pair_difference(ii, name, a, b), pair_difference(ish, name, a, b)
            ratio, lo, hi = bootstrap_ratio(d_crn, d_ind, rng)
            print(f"{a + ' - ' + b:<28}{name:<12}{np.nanmean(per_replicate_var(d_ind[:, None])):>10.4g}"
                  f"{np.nanmean(per_replicate_var(d_crn[:, None])):>10.4g}{ratio:>13.2f}  [{lo:.2f}, {hi:.2f}]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("-R", "--replicates", type=int, default=16)
    ap.add_argument("-T", "--horizon", type=int, default=10)
    ap.add_argument("--target-tokens", type=int, default=128)
    ap.add_argument("--policies", default="snapkv@0.9,snapkv@0.5,recent@0.5")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="model id (default: the embedded SmolLM2; tiny:llama to smoke-test)")
    ap.add_argument("--crn", action="store_true", help="also measure common random numbers (residual traces)")
    args = ap.parse_args()
    start = time.perf_counter()
    engine = Engine(load_model(args.model), PolicyRegistry())
    docs = prompts(engine, args.docs, args.target_tokens)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    T, R = args.horizon, args.replicates
    print(f"model {engine.lm.name} on {engine.lm.device}; {len(docs)} documents, prompts "
          f"{min(len(i) for _, i in docs)}-{max(len(i) for _, i in docs)} tokens; policies {policies}")
    collect(engine, docs[:1], policies[:1], "residual", T, R, args.seed + 1, common=False)  # warm-up, untimed
    crude, secs_c = collect(engine, docs, policies, "coupled", T, R, args.seed, common=False)
    resid, secs_r = collect(engine, docs, policies, "residual", T, R, args.seed, common=False)
    rng = np.random.default_rng(args.seed)
    efficiency_table(crude, resid, secs_c, secs_r, policies, T, R, rng)
    if args.crn:
        shared, _ = collect(engine, docs, policies, "residual", T, R, args.seed, common=True)
        crn_table(resid, shared, policies, rng)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
