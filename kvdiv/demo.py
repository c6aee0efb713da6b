"""``kvdiv demo``: the paper's study end to end on the two embedded models, on a laptop CPU.

As the paper studies two models, the demo studies SmolLM2-135M-Instruct (a chat model)
and Gemma 3 270M (a base model: its documents go in as raw text, the instruction after
them, no chat template), the same documents, policies and sizes on each, one model
after the other (``--models`` picks one or both). Each model's traces are collected
into its own folder (``--out``/MODEL/), then combined along a ``model`` dim
(``protocols.combine``) and analysed once: the plan's hypotheses per model, Holm
spanning both, every report section per model, the headline table per model.

Steps for each model (each shown on stderr as it runs):

1. start ``kvdiv serve --model MODEL`` on a free loopback port, unless ``--server``
   URLs are given (one model then: the servers' own);
2. build the built-in document set (CPython's language reference, chunked with the
   model's tokenizer) while the server loads;
3. collect residual-branch traces for the paper's policies: ``snapkv@0.5``,
   ``snapkv#N`` with N about half the median prompt, ``recent@0.5`` and ``snapkv@0.9``, and the
   sweep of "How much can I compress?" (``kvdiv.demo_spec.SWEEP``: snapkv and recent at 0.3 besides);
   then a small reference set for the speculative-decoding section: paths from the
   full model scored by ``snapkv@0.5`` and ``recent@0.5`` on the first few documents
   (``kvdiv collect --kind reference``, in ``reference/``); on SmolLM2, the pass-key set:
   greedy coupled answers to 30 pass-key documents, scored (``kvdiv.passkey``, in ``passkey/``);
4. stop the server, pack ``traces.nc`` (and ``reference.nc``); with several models,
   combine them along ``model`` into ``--out``/traces.nc (and reference.nc);
5. run the shipped plan (``paper``, divstats package data) with ``snapkv#512`` substituted by
   ``snapkv#N`` (a recorded deviation: the two budget rows are labelled
   exploratory), writing ``results.nc``, ``report.html`` and ``summary.md``.

Everything lives in ``--out`` (default ``runs/demo``). The collection is a journal
(see ``collector.journal``), so an interrupted demo rerun with the same options
resumes where it stopped; the demo's own settings are kept in ``demo.json`` and a
rerun with different sizes is refused rather than mixed in.

This module is the orchestration only. What is studied is data (``kvdiv.demo_spec``:
``DEMO_STUDY`` and the run's ``DemoConfig``); the documents and N (``kvdiv.demo_documents``),
the derived plan (``kvdiv.demo_plan``), the server's life (``kvdiv.server_process``) and
the printed headline (``divstats.report.headline``) each have their own module.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from collector import documents as D
from collector.collect import CollectConfig, collect
from collector.pack import pack_run, save_dataset
from divstats import certify_headline, headline, speculative_headline
from kvdiv import passkey
from kvdiv.demo_documents import prepare_documents
from kvdiv.demo_plan import shipped_plan, write_demo_plan
from kvdiv.demo_spec import (
    DEMO_STUDY,
    PLANNED_BUDGET_POLICY,
    DemoConfig,
    DemoError,
    ModelPart,
    TraceSet,
    budget_policy,
    demo_policies,
)
from kvdiv.server_process import ServerError, ServerProcess, terminate_as_interrupt

__all__ = ["SET_ANALYSES", "SetAnalysis", "run_demo"]


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the demo


def run_demo(cfg: DemoConfig) -> Any:
    """Run every step; returns divstats' Analysis. Raises DemoError with advice on failure."""
    cfg.out = Path(cfg.out)
    cfg.out.mkdir(parents=True, exist_ok=True)
    with terminate_as_interrupt():
        return _run(cfg)


def _run(cfg: DemoConfig) -> Any:
    t0 = time.monotonic()
    if cfg.servers and len(cfg.models) > 1:
        raise DemoError(f"--server serves one model; pass one of --models ({', '.join(cfg.models)}) with it")
    _say(f"kvdiv demo → {cfg.out}  ({', '.join(cfg.models)}: {cfg.docs_count} docs × "
         f"{len(demo_policies(1))} policies, "
         f"R={cfg.replicates_text()}, T={cfg.max_new_tokens}, W={cfg.window}, residual traces)")
    parts = cfg.parts()
    docs_path, budget, plan = None, 0, cfg.plan
    tags = {p.model: f"[{p.model}] " if len(parts) > 1 else "" for p in parts}
    with ExitStack() as servers_up:
        # Every model's server starts now: a later model loads and checks itself while an
        # earlier one collects (a CPU server's decoding loop leaves a core partly idle).
        servers: dict[str, ServerProcess | None] = {}
        for part in parts:
            servers[part.model] = server = servers_up.enter_context(_serving(cfg, part))
            if server is not None:
                _say(f"{tags[part.model]}[1/5] starting `kvdiv serve --model {part.model}` (log: {server.log_path})")
            else:
                _say(f"{tags[part.model]}[1/5] using running server(s): {', '.join(cfg.servers)}")
        for part in parts:
            tag, server = tags[part.model], servers[part.model]
            if docs_path is None:   # built once, while the servers load
                _say(f"{tag}[2/5] documents")
                docs_path, budget = prepare_documents(cfg, _say)
                plan = cfg.plan or write_demo_plan(shipped_plan(), cfg.out / "plan.toml", budget, cfg.window,
                                                   confirmatory_docs=(cfg.docs_count + 1) // 2)
                _say(f"      plan: {plan}")
            urls = list(cfg.servers) if server is None else [_ready(server, cfg.server_timeout_s)]
            if server is not None:
                _say(f"      server ready at {urls[0]} after {time.monotonic() - t0:.0f} s")
            _collect_part(cfg, part, urls, docs_path, budget, server, tag)
            if server is not None:
                server.stop()   # its model is done: its memory and threads go to the next
            _say(f"{tag}[4/5] packing traces.nc" + "".join(f" and {ts.file}" for ts in cfg.trace_sets()))
            _pack_part(cfg, part)
    files = _combined(cfg, parts)
    _say(f"[5/5] analysing with {plan}")
    an = _analyse(cfg, files["traces.nc"], plan, budget)
    further = [(ts, SET_ANALYSES[ts.name], SET_ANALYSES[ts.name].analyse(cfg, files[ts.file]))
               for ts in cfg.trace_sets()]
    elapsed = time.monotonic() - t0
    print(headline(an, DEMO_STUDY.headline_quantities) + certify_headline(an))
    for _, how, result in further:
        print(how.headline(result))
    print(f"\nreport: {cfg.out / 'report.html'}   summary: {cfg.out / 'summary.md'}")
    print(f"traces: {files['traces.nc']}   results: {cfg.out / 'results.nc'}   ({elapsed:.0f} s)")
    for ts, how, result in further:
        print(how.footer(result, files[ts.file]))
    return an


# --------------------------------------------------------------------------- the servers


@contextmanager
def _serving(cfg: DemoConfig, part: ModelPart) -> Iterator[ServerProcess | None]:
    """A started server (stopped on exit, Ctrl-C included), or None when --server is given."""
    if cfg.servers:
        yield None
        return
    args = ["--model", part.model, "--port", "0", "--max-queue", "64", "--log-level", "warning"]
    with ServerProcess(args, part.out / "server.log", env={"KVDIV_API_KEY": cfg.api_key} if cfg.api_key else None,
                       ) as server:
        yield server


def _ready(server: ServerProcess, timeout_s: float) -> str:
    try:
        return server.wait_ready(timeout_s)
    except ServerError as exc:
        raise DemoError(str(exc)) from None


def _stop_check(server: ServerProcess | None) -> Callable[[], str | None] | None:
    """The collector's stop check: why the demo's server is gone, or None while it runs."""
    if server is None:
        return None

    def gone() -> str | None:
        why = server.exit_reason()
        return None if why is None else f"{why}. Rerun the same command to resume."
    return gone


# --------------------------------------------------------------------------- collecting


def _collect_part(cfg: DemoConfig, part: ModelPart, urls: list[str], docs_path: Path, budget: int,
                  server: ServerProcess | None, tag: str) -> None:
    """One model's traces: the residual set (and the control), then each further set."""
    policies = demo_policies(budget)
    _say(f"{tag}[3/5] collecting traces: {', '.join(policies)}" + (" + the control full" if cfg.control else "")
         + (f" (template {part.template})" if part.template != cfg.template else ""))
    stop = _stop_check(server)
    result = collect(CollectConfig.flat(
        servers=urls, docs_file=docs_path, policies=policies, out=part.out / "journal", kind="residual",
        replicates=part.replicates, max_new_tokens=cfg.max_new_tokens, window=cfg.window,
        temperature=1.0, seed=cfg.seed, template=part.template, api_key=cfg.api_key,
        concurrency=cfg.concurrency, progress=cfg.progress, control=cfg.control),
        stop_reason=stop)
    _say(f"      {result.summary()}")
    if not result.ok:
        raise DemoError((stop and stop()) or f"{len(result.failed)} requests failed; rerun the same command to "
                        f"retry them ({part.out / 'journal'} keeps every complete request)")
    for ts in cfg.trace_sets():
        if ts.applies(part.model):
            _collect_set(cfg, part, ts, urls, docs_path, stop)


def _set_documents(cfg: DemoConfig, part: ModelPart, ts: TraceSet, docs_path: Path) -> list[D.Document]:
    """A further set's documents: its task's (``kvdiv docs --task``, counted with the model's tokenizer),
    or the first ``ts.docs`` of the study's."""
    if not ts.task:
        return D.read_jsonl(docs_path)[:ts.docs]
    from collector.tasks import task_documents
    from kvdiv.demo_documents import load_tokenizer

    return task_documents(ts.task, ts.docs, target_tokens=ts.target_tokens, tokenizer=load_tokenizer(part.model),
                          seed=cfg.seed)


def _collect_set(cfg: DemoConfig, part: ModelPart, ts: TraceSet, urls: list[str], docs_path: Path,
                 stop: Callable[[], str | None] | None) -> None:
    """A further set: its documents (:func:`_set_documents`), each scored by ``ts.policies``.

    Its own journal (``<name>/journal`` in the model's folder), so that a rerun resumes it like the main one.
    """
    root = part.out / ts.name
    docs = _set_documents(cfg, part, ts, docs_path)
    path = root / "documents.jsonl"
    if path.exists() and D.read_jsonl(path) != docs:
        raise DemoError(f"{path} holds other {ts.name} documents than these settings give; rerun with the same "
                        "options to resume, or pass a new --out")
    set_docs = D.write_jsonl(docs, path)
    T = ts.max_new_tokens or cfg.max_new_tokens
    _say(f"      {ts.name} traces: {len(docs)} docs × {', '.join(ts.policies)}"
         + (" + the control full" if ts.control else "") + f", R={ts.replicates}, T={T}"
         + (", greedy" if ts.temperature == 0 else ""))
    result = collect(CollectConfig.flat(
        servers=urls, docs_file=set_docs, policies=list(ts.policies), out=root / "journal",
        kind=ts.kind, replicates=ts.replicates, max_new_tokens=T,
        temperature=ts.temperature, seed=cfg.seed, template=ts.template or part.template, api_key=cfg.api_key,
        concurrency=cfg.concurrency, progress=cfg.progress, control=ts.control),
        stop_reason=stop)
    _say(f"      {result.summary()}")
    if not result.ok:
        raise DemoError((stop and stop()) or f"{len(result.failed)} {ts.name} requests failed; rerun the same "
                        f"command to retry them ({root / 'journal'} keeps every complete request)")


def _pack_part(cfg: DemoConfig, part: ModelPart) -> None:
    save_dataset(pack_run(part.out / "journal", progress=False), part.out / "traces.nc", overwrite=True)
    for ts in cfg.trace_sets():
        if ts.applies(part.model):
            save_dataset(pack_run(part.out / ts.name / "journal", progress=False), part.out / ts.file,
                         overwrite=True)


def _combined(cfg: DemoConfig, parts: list[ModelPart]) -> dict[str, Path]:
    """The traces to analyse by file name (``traces.nc`` and each further set's): one model's own
    files, or every model's combined along ``model`` (named by the short ids) into ``cfg.out``."""
    names = {"traces.nc": parts, **{ts.file: [p for p in parts if ts.applies(p.model)] for ts in cfg.trace_sets()}}
    out = {name: on[0].out / name for name, on in names.items() if len(on) == 1}   # one model's own file
    if len(parts) == 1:
        return out
    import protocols
    from collector.rounds import pad_replicates

    _say(f"      combining {', '.join(p.model for p in parts)} along model")
    for name, on in names.items():
        if len(on) < 2:
            continue
        models = [p.model for p in on]
        sets = [protocols.open_traces(p.out / name).load() for p in on]
        # a model studied at a smaller R holds absent replicates in the others' slots
        # (docs/contract.md): every estimate is that of its own R (residual traces only)
        width = max(ds.sizes["replicate"] for ds in sets)
        sets = [pad_replicates(ds, width) for ds in sets]
        out[name] = save_dataset(protocols.combine(sets, "model", models=models), cfg.out / name, overwrite=True)
    return out


# --------------------------------------------------------------------------- analysing


def _analyse(cfg: DemoConfig, traces: Path, plan: Path, budget: int) -> Any:
    from divstats import analyze

    # An explicit --plan is run as written, the budget policy substituted post hoc
    # (a recorded deviation); the derived demo plan carries its own alias.
    aliases = {}
    if cfg.plan is not None and budget_policy(budget) != PLANNED_BUDGET_POLICY:
        aliases = {PLANNED_BUDGET_POLICY: budget_policy(budget)}
    return analyze(traces, plan, cfg.out, policy_aliases=aliases, seed=cfg.seed,
                   n_resamples=cfg.n_resamples, progress=cfg.progress)


def _analyse_reference(cfg: DemoConfig, traces: Path) -> Any:
    """The reference set's own report (``speculative/``): its Speculative decoding section.

    Descriptive (no plan: the demo prespecifies no speculative hypothesis) and without a
    cost ratio (the traces do not time the draft apart from the target), so it shows
    tokens per call against γ, not a speedup."""
    from divstats import analyze

    return analyze(traces, None, cfg.out / "speculative", seed=cfg.seed, n_resamples=cfg.n_resamples,
                   progress=False)


@dataclass(frozen=True)
class SetAnalysis:
    """How the demo analyses a further trace set and what it prints of it.

    Attributes
    ----------
    analyse : callable
        (config, the set's traces) -> its analysis, run after the main one.
    headline : callable
        analysis -> the lines printed after the main headline.
    footer : callable
        (analysis, the set's traces) -> the line printed after the main report's paths.
    """

    analyse: Callable[[DemoConfig, Path], Any]
    headline: Callable[[Any], str]
    footer: Callable[[Any, Path], str]


#: Each further trace set of ``kvdiv.demo_spec.DEMO_STUDY``, by name: how it is analysed and printed.
SET_ANALYSES: dict[str, SetAnalysis] = {
    "reference": SetAnalysis(
        _analyse_reference, speculative_headline,
        lambda an, traces: f"speculative decoding: {an.paths['report.html']}   reference traces: {traces}"),
    "passkey": SetAnalysis(passkey.analyse, passkey.headline, passkey.footer),
}
