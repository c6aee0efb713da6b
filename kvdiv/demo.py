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
   sweep of "How much can I compress?" (``SWEEP``: snapkv and recent at 0.3 besides);
   then a small reference set for the speculative-decoding section: paths from the
   full model scored by ``snapkv@0.5`` and ``recent@0.5`` on the first few documents
   (``kvdiv collect --kind reference``, in ``reference/``);
4. stop the server, pack ``traces.nc`` (and ``reference.nc``); with several models,
   combine them along ``model`` into ``--out``/traces.nc (and reference.nc);
5. run the shipped plan (``paper``, divstats package data) with ``snapkv#512`` substituted by
   ``snapkv#N`` (a recorded deviation: the two budget rows are labelled
   exploratory), writing ``results.nc``, ``report.html`` and ``summary.md``.

Everything lives in ``--out`` (default ``runs/demo``). The collection is a journal
(see ``collector.journal``), so an interrupted demo rerun with the same options
resumes where it stopped; the demo's own settings are kept in ``demo.json`` and a
rerun with different sizes is refused rather than mixed in.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, TextIO

from collector import documents as D
from collector.collect import CollectConfig, collect
from collector.pack import pack_run, save_dataset

PLANNED_BUDGET_POLICY = "snapkv#512"
#: The drafts the demo's reference traces score (docs/collector.md, "The demo").
REFERENCE_POLICIES = ("snapkv@0.5", "recent@0.5")
SERVER_READY = "kvdiv serve ready: "
# Tokens the chat template adds around the user turn (ChatML: role markers, newlines).
CHAT_OVERHEAD_TOKENS = 8
#: The models the demo studies by default, as the paper studies two: the embedded chat
#: model and the embedded base model (gen_service.models.EMBEDDED_MODELS).
DEFAULT_MODELS = ("smollm2-135m", "gemma3-270m")
#: R of a model's residual traces when ``-R`` is not given. Gemma 3 270M's step costs several
#: times SmolLM2's on a CPU (its 262k-token head and the sampling over it), so its part is
#: sized at half the replicates (docs/collector.md, "What the second model costs"); other
#: models get :data:`DEFAULT_REPLICATES`.
MODEL_REPLICATES: dict[str, int] = {"smollm2-135m": 4, "gemma3-270m": 2}
DEFAULT_REPLICATES = 4


class DemoError(RuntimeError):
    """A demo step that failed, with what to do about it."""


@dataclass
class DemoConfig:
    """Demo sizes. Defaults are sized to ``make demo``'s 10 minutes on 2 CPU cores, the
    install included: 8 min 55 s were measured with both models from a fresh clone
    (docs/collector.md, "What the second model costs"). Every model gets the same documents, policies, T and W: traces
    combine along ``model`` only when they agree on those; a model studied at a smaller R
    holds absent replicates in the others' slots."""

    out: Path = Path("runs/demo")
    docs_count: int = 10
    target_tokens: int = 128
    #: R for every model; None: each model's own (:data:`MODEL_REPLICATES`)
    replicates: int | None = None
    max_new_tokens: int = 8
    window: int = 7   # W = T - 1: branches reach the horizon, so every estimand is identified
    seed: int = 0
    servers: list[str] = field(default_factory=list)
    #: the models studied, one after the other (short ids as ``kvdiv serve --model`` takes)
    models: list[str] = field(default_factory=lambda: list(DEFAULT_MODELS))
    concurrency: int = 8   # keeps the local server's queue full (a CPU server decodes one request at a time)
    api_key: str | None = None
    template: str = "summarise"
    plan: Path | None = None
    n_resamples: int = 2000
    progress: bool = True
    server_timeout_s: float = 900.0
    #: Collect the numerical control (``full`` as a candidate, ``kvdiv collect --control``): one more
    #: candidate in each document's request, about +25% collection time (docs/collector.md, "The control").
    control: bool = True
    #: Reference traces (paths from P with log p and log q, for speculative decoding) on the first
    #: ``reference_docs`` documents × :data:`REFERENCE_POLICIES`, R = ``reference_replicates``, the same T;
    #: 0 documents skips them. Small on purpose (one grouped request per document), yet the 10
    #: documents that intervals over documents need (``MIN_DOCS_AGGREGATE``); analysed into
    #: ``speculative/`` (docs/collector.md, "The demo").
    reference_docs: int = 10
    reference_replicates: int = 2

    def sizes(self) -> dict[str, Any]:
        """The settings that decide the traces (compared on resume)."""
        out = {k: v for k, v in asdict(self).items()
               if k in ("docs_count", "target_tokens", "max_new_tokens", "window", "seed", "template", "models")}
        return {**out, "replicates": {m: self.replicates_for(m) for m in self.models}}

    def replicates_for(self, model: str) -> int:
        """R of a model's residual traces: ``replicates`` when set, else the model's own."""
        return self.replicates or MODEL_REPLICATES.get(model, DEFAULT_REPLICATES)

    def reference_r(self) -> int:
        """R of every model's reference traces: ``reference_replicates``, at most the smallest
        residual R (a model sized down for time is sized down in both sets; reference traces
        hold no absent replicates, docs/contract.md, so every model gets the same R)."""
        return min([self.reference_replicates] + [self.replicates_for(m) for m in self.models])

    def parts(self) -> list[ModelPart]:
        """One part per model: its folder (``out`` itself for a single model, as before), template and R."""
        many = len(self.models) > 1
        return [ModelPart(m, self.out / model_slug(m) if many else self.out, template_for(m, self.template),
                          self.replicates_for(m)) for m in self.models]


@dataclass(frozen=True)
class ModelPart:
    """One model's part of the study: its model id, its folder (journal, traces, server
    log) and its prompt template (the raw form for a base model)."""

    model: str
    out: Path
    template: str
    replicates: int = DEFAULT_REPLICATES


def _replicates_text(cfg: DemoConfig) -> str:
    """R as the opening line states it: one number, or each model's."""
    rs = {m: cfg.replicates_for(m) for m in cfg.models}
    return str(next(iter(rs.values()))) if len(set(rs.values())) == 1 else \
        " / ".join(f"{r} ({m})" for m, r in rs.items())


def model_slug(model: str) -> str:
    """A folder name for a model id (``tiny:llama`` -> ``tiny-llama``)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", model).strip("-") or "model"


def template_for(model: str, template: str) -> str:
    """The template a model reads its documents with: a base model (no chat template,
    e.g. ``gemma3-270m``) gets the raw form (``summarise-raw``: the document as raw
    text, the instruction after it)."""
    if model in ("approx",) or template.endswith(D.RAW_SUFFIX):
        return template
    try:
        from gen_service.models.loading import EMBEDDED_MODELS
    except ModuleNotFoundError:   # a base install: no server here, the servers' models are chat models
        return template
    embedded = EMBEDDED_MODELS.get(model)
    return template + D.RAW_SUFFIX if embedded is not None and not embedded.chat else template


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- server


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux to SIGTERM it when the demo dies, even by SIGKILL.

    Without this, a demo killed hard would leave a model server running on the port.
    """
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass


@contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """Treat SIGTERM like Ctrl-C, so `kill <demo>` also stops the server and keeps the journal."""
    import signal

    def raise_interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, raise_interrupt)
    except ValueError:  # not the main thread (e.g. called from a worker): leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class ServerProcess:
    """``kvdiv serve`` as a child process; its output goes to a log file."""

    def __init__(self, model: str, log_path: Path, api_key: str | None = None) -> None:
        cmd = [sys.executable, "-m", "kvdiv", "serve", "--model", model, "--port", "0",
               "--max-queue", "64", "--log-level", "warning"]
        env = dict(os.environ)
        if api_key:
            env["KVDIV_API_KEY"] = api_key
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._log: TextIO = open(log_path, "a", encoding="utf-8")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env,
                                     preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        self.url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        # The server prints its bound URL once it accepts connections (port 0 = any free port).
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            if line.startswith(SERVER_READY) and self.url is None:
                self.url = line[len(SERVER_READY):].split()[0]
                self._ready.set()
        self._ready.set()  # EOF: the process ended

    def wait_ready(self, timeout_s: float) -> str:
        if not self._ready.wait(timeout_s) or self.url is None:
            code = self.proc.poll()
            self.stop()
            why = (f"exited with code {code} before it was ready" if code is not None
                   else f"did not start within {timeout_s:.0f} s")
            raise DemoError(f"the server {why}; the end of {self.log_path}:\n{self._log_tail()}")
        _wait_health(self.url)
        return self.url

    def exit_reason(self) -> str | None:
        """Why the server is gone, or None while it runs (the collector's stop check)."""
        code = self.proc.poll()
        if code is None:
            return None
        return (f"the demo's server exited (code {code}); see {self.log_path}. "
                "Rerun the same command to resume.")

    def _log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(encoding="utf-8").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _wait_health(url: str, timeout_s: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise DemoError(f"{url}/health did not answer 200 within {timeout_s:.0f} s")
        time.sleep(0.5)


@contextmanager
def _serving(cfg: DemoConfig, part: ModelPart) -> Iterator[ServerProcess | None]:
    """A started server (stopped on exit, Ctrl-C included), or None when --server is given."""
    if cfg.servers:
        yield None
        return
    server = ServerProcess(part.model, part.out / "server.log", cfg.api_key)
    try:
        yield server
    finally:
        server.stop()


# --------------------------------------------------------------------------- documents and policies


def load_tokenizer(model_id: str | None = None) -> Any | None:
    """The tokenizer of a model id as ``kvdiv serve --model`` understands it, without its weights.

    ``approx`` gives None (the tokenizer-free count). The embedded SmolLM2 reads the
    server's dequantised cache when a server has started once (fast), else parses the
    GGUF (~8 s on 2 cores).
    """
    if model_id == "approx":
        return None
    from transformers.utils import logging as hf_logging

    from gen_service.models import loading  # the service's loader: ids mean the same thing here

    # Counting whole topics before chunking exceeds model_max_length by design; the
    # "sequence length is longer than the maximum" warning would only alarm users.
    hf_logging.set_verbosity_error()

    return loading.load_tokenizer(model_id)


def prompt_length(tokenizer: Any | None) -> Callable[[list[dict[str, str]]], int]:
    """Tokens the server will prefill for chat ``messages``.

    With a chat template this is exact (SmolLM2's template adds a default system
    turn of ~20 tokens); otherwise the user turn plus a small allowance.
    """
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        def exact(messages: list[dict[str, str]]) -> int:
            ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
            return len(ids if isinstance(ids, list) else ids["input_ids"])
        return exact
    count = D.token_counter(tokenizer)
    return lambda messages: sum(count(m["content"]) for m in messages) + CHAT_OVERHEAD_TOKENS


def budget_for(docs: Sequence[D.Document], template: str,
               length: Callable[[list[dict[str, str]]], int]) -> int:
    """N for ``snapkv#N``: half the median prompt length (document, template and chat turn)."""
    prompts = [length(D.render_messages(d, template)) for d in docs]
    return max(1, int(round(statistics.median(prompts) / 2)))


#: The sweep of "How much can I compress?" (docs/plans.md): each method at these retentions. The paper's
#: policies already hold snapkv@0.9, snapkv@0.5 and recent@0.5, so it adds two candidates to each
#: document's grouped request (their prompt is shared; the demo's wall time grows by about 2/5 of collecting).
SWEEP: dict[str, tuple[float, ...]] = {"snapkv": (0.9, 0.5, 0.3), "recent": (0.5, 0.3)}
#: What the demo plan certifies for each swept method: the mismatch fraction at this margin, all documents.
CERTIFY_METRIC, CERTIFY_MARGIN = "mismatch_fraction", 0.05


def with_sweep(policies: Sequence[str]) -> list[str]:
    """``policies`` and the members of :data:`SWEEP` they lack (a family's budgets, in one grouped request)."""
    extra = [f"{method}@{r:g}" for method, rs in SWEEP.items() for r in rs]
    return list(policies) + [p for p in extra if p not in policies]


def demo_policies(budget: int) -> list[str]:
    return with_sweep(["snapkv@0.5", f"snapkv#{budget}", "recent@0.5", "snapkv@0.9"])


def certify_toml() -> str:
    """The demo plan's ``[[certify]]`` tables: one per swept method (docs/plans.md, "How much can I compress?")."""
    return "".join(f'\n[[certify]]\nid = "compress-{m}"\nfamily = "{m}"\nmetric = "{CERTIFY_METRIC}"\n'
                   f'margin = {CERTIFY_MARGIN}\nsplit = "all"\n' for m in SWEEP)


def certify_headline(an: Any) -> str:
    """The certified budget per method (and model), in words, for the printed headline."""
    pr = getattr(an, "plan_result", None)
    if pr is None or not len(pr.certify):
        return ""
    lines = [f"\n  How much can I compress? ({CERTIFY_METRIC} within {CERTIFY_MARGIN:g} of the full model, "
             f"fixed-sequence, α = {float(pr.certify['alpha'].iloc[0]):g}):"]
    for r in pr.certify.itertuples(index=False):
        who = f"{r.family}" + ("" if r.model is None else f" [{r.model}]")
        said = (f"certified down to {r.certified} (KV kept {_num(r.certified_kept)})" if r.certified
                else f"none certified — {r.reason}")
        lines.append(f"  {who:<24} {said}")
    return "\n".join(lines)


def select_balanced(docs: Sequence[D.Document], count: int, plan: Path) -> list[D.Document]:
    """``count`` documents, half in each of the plan's splits (confirmatory first when odd).

    The plan assigns documents by a salted hash of their ids, so a plain subset of
    14 may hold only 4 confirmatory documents, too few for any test to reject.
    Choosing by id alone, before any trace exists, leaves the split and the tests
    as prespecified; within each half the choice is D.select's stable spread.
    """
    from divstats import assign_split, load_plan

    spec = load_plan(plan)
    ranked = sorted(docs, key=D.select_key)
    labels = dict(zip([d.id for d in ranked], assign_split([d.id for d in ranked], spec.salt,
                                                           spec.confirmatory_fraction), strict=True))
    want = {"confirmatory": (count + 1) // 2, "exploratory": count // 2}
    chosen: set[str] = set()
    for doc in ranked:
        if want.get(labels[doc.id], 0) > 0:
            want[labels[doc.id]] -= 1
            chosen.add(doc.id)
    return [d for d in docs if d.id in chosen]


def _prepare_documents(cfg: DemoConfig) -> tuple[Path, int]:
    """documents.jsonl and the budget N: built once, then reused so that reruns resume."""
    settings_path = cfg.out / "demo.json"
    docs_path = cfg.out / "documents.jsonl"
    if settings_path.exists() and docs_path.exists():
        saved = json.loads(settings_path.read_text(encoding="utf-8"))
        if saved["sizes"] != cfg.sizes():
            diffs = [f"{k}: {saved['sizes'].get(k)!r} there, {v!r} now" for k, v in cfg.sizes().items()
                     if saved["sizes"].get(k) != v]
            raise DemoError(f"{cfg.out} holds a demo with other settings ({'; '.join(diffs)}). "
                            "Rerun with the same options to resume it, or pass a new --out.")
        _say(f"      reusing {docs_path} ({saved['n_docs']} documents, snapkv#{saved['budget']})")
        return docs_path, int(saved["budget"])
    # one document set for every model (traces combine along model only over the same
    # documents), chunked with the first model's tokenizer
    _say(f"      loading the {cfg.models[0]} tokenizer and chunking pydoc_data.topics to ~{cfg.target_tokens} tokens")
    tokenizer = load_tokenizer(cfg.models[0])
    docs = select_balanced(D.pydoc_documents(tokenizer, target_tokens=cfg.target_tokens), cfg.docs_count,
                           cfg.plan or shipped_plan())
    budget = budget_for(docs, cfg.template, prompt_length(tokenizer))
    D.write_jsonl(docs, docs_path)
    settings = {"sizes": cfg.sizes(), "budget": budget, "n_docs": len(docs), "policies": demo_policies(budget)}
    settings_path.write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    for line in D.iter_summary(docs):
        _say(f"      {line}")
    return docs_path, budget


# --------------------------------------------------------------------------- analysis


def shipped_plan() -> Traversable:
    """The shipped paper plan (package data of divstats, so a wheel install has it too)."""
    from divstats import shipped_plan as packaged

    return packaged("paper")


def headline(an: Any) -> str:
    """The plan table, one block per model (one line per hypothesis), plus each model's
    per-policy occurrence and rmtd and its noise floor."""
    table = an.plan_result.table
    agg = an.aggregate
    models = [str(m) for m in agg["model"].values] if "model" in agg.dims else [None]
    lines = [f"plan {an.plan.name} (sha256 {an.plan.sha256[:12]}…)"
             + (f", Holm within each family over {len(models)} models" if len(models) > 1 else "")]
    for model in models:
        rows = table if model is None else table[table["model"] == model]
        n_docs = int(rows["n_docs"].max()) if len(rows) else 0
        lines.append(("" if model is None else f"\n  model {model}: ") + f"{n_docs} confirmatory docs")
        lines += _plan_lines(rows)
        lines += _policy_lines(an, None if model is None else agg.sel(model=model))
        lines.append(_floor_line(an, model))
    return "\n".join(lines)


def _plan_lines(rows: Any) -> list[str]:
    lines = [f"  {'hypothesis':<18} {'A − B':<34} {'mean A':>8} {'mean B':>8} {'effect':>8} "
             f"{'p (Holm)':>9}  reject  label"]
    for r in rows.itertuples(index=False):
        comp = f"{r.a} − {r.b}" + (f" ({r.policy})" if r.policy else "")
        hid = r.id.split("[")[0]     # the model is the block's
        lines.append(f"  {hid:<18} {comp:<34} {_num(r.mean_a):>8} {_num(r.mean_b):>8} {_num(r.effect):>8} "
                     f"{_num(r.p_adjusted):>9}  {'yes' if r.reject else 'no':<6}  {r.label}")
    return lines


def _policy_lines(an: Any, agg: Any | None) -> list[str]:
    """One model's occurrence, rmtd and exposure per policy, over all documents (descriptive)."""
    agg = an.aggregate if agg is None else agg
    shown = [q for q in ("occurrence", "rmtd", "exposure") if q in agg.data_vars]
    if not shown:
        return []
    lines = ["", f"  {'policy':<14}" + "".join(f"{q:>12}" for q in shown) + "   (all docs, descriptive)"]
    for pol in agg["policy"].values:
        lines.append(f"  {str(pol):<14}" + "".join(f"{_num(float(agg[q].sel(policy=pol))):>12}" for q in shown)
                     + ("   (control: the noise floor)" if pol == _control(an) else ""))
    return lines


def _control(an: Any) -> str | None:
    floor = getattr(an, "noise_floor", None)
    return (floor.attrs.get("control") or None) if floor is not None else None


def _floor_line(an: Any, model: str | None = None) -> str:
    """The noise floor in one line (one model's): the control's occurrence and max TV, or that none was collected."""
    floor = getattr(an, "noise_floor", None)
    if floor is None or not floor.attrs.get("control"):
        return "\n  noise floor: no control collected"
    if "model" in floor.dims:
        if model is None:
            return f"\n  noise floor ({floor.attrs['control']} vs full): per model, see the report"
        floor = floor.sel(model=model)
    return (f"\n  noise floor ({floor.attrs['control']} vs full): occurrence "
            f"{_num(float(floor['aggregate_occurrence']))}, max TV {float(floor['aggregate_max_tv']):.3g}")


def _num(x: Any) -> str:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return str(x)
    return "nan" if math.isnan(v) else f"{v:.3g}"


def demo_windows(window: int) -> dict[str, tuple[int, int]]:
    """The paper's early/late ages ([1, 8], [16, 32] for W = 32) scaled to the demo's W."""
    return {"early": (1, max(1, window // 4)), "late": (max(2, window // 2), window)}


def write_demo_plan(source: Path, target: Path, budget: int, window: int, confirmatory_docs: int | None = None,
                    ) -> Path:
    """The demo's plan: the shipped plan with its budget policy and windows fitted to a CPU run.

    Written into the run directory *before* any trace is collected (and never
    rewritten), so it is prespecified: the hypotheses, tests, split salt and
    families are the paper's; only ``snapkv#512`` becomes ``snapkv#N`` (as a plan
    alias, see docs/plans.md) and the age windows shrink with W, because a
    late window of ages 16-32 needs T > 32 decoding steps per branch, several
    times what fits in the demo's minutes on 2 cores. With fewer than
    ``divstats.MIN_DOCS_MEAN_BOUND`` confirmatory documents the
    hypotheses become two-sided: a one-sided test of a mean is refused there (its
    size does not hold on skewed differences, docs/plans.md), a two-sided one holds
    it from 5 documents.
    """
    if target.exists():
        return target
    from divstats import MIN_DOCS_MEAN_BOUND

    text = source.read_text(encoding="utf-8")
    windows = demo_windows(window)
    for name, (first, last) in windows.items():
        text, n = re.subn(rf"(?m)^{name}\s*=\s*\[[^\]]*\]", f"{name} = [{first}, {last}]", text)
        if n != 1:
            raise DemoError(f"{source}: expected one `{name} = [a, b]` line in [windows] to adapt")
    text = re.sub(r'(?m)^name\s*=\s*"([^"]*)"', r'name = "\1-demo"', text, count=1)
    two_sided = confirmatory_docs is not None and confirmatory_docs < MIN_DOCS_MEAN_BOUND
    if two_sided:
        text = re.sub(r'(?m)^direction\s*=\s*"(less|greater)"', 'direction = "two-sided"', text)
    header = (f"# Derived by `kvdiv demo` from {source.name} before collecting: windows scaled to "
              f"W = {window}, {PLANNED_BUDGET_POLICY} -> snapkv#{budget}"
              + (f"; directions two-sided ({confirmatory_docs} confirmatory documents, one-sided tests "
                 f"of a mean need {MIN_DOCS_MEAN_BOUND})" if two_sided else "") + ".\n")
    text = (header + text.rstrip("\n") + f'\n\n[aliases]\n"{PLANNED_BUDGET_POLICY}" = "snapkv#{budget}"\n'
            + certify_toml())
    from divstats import load_plan

    load_plan(text)  # refuse to write a plan that does not load
    target.write_text(text, encoding="utf-8")
    return target


def _analyse(cfg: DemoConfig, traces: Path, plan: Path, budget: int) -> Any:
    from divstats import analyze

    # An explicit --plan is run as written, the budget policy substituted post hoc
    # (a recorded deviation); the derived demo plan carries its own alias.
    aliases = {}
    if cfg.plan is not None and budget != 512:
        aliases = {PLANNED_BUDGET_POLICY: f"snapkv#{budget}"}
    return analyze(traces, plan, cfg.out, policy_aliases=aliases, seed=cfg.seed,
                   n_resamples=cfg.n_resamples, progress=cfg.progress)


# --------------------------------------------------------------------------- the demo


def run_demo(cfg: DemoConfig) -> Any:
    """Run every step; returns divstats' Analysis. Raises DemoError with advice on failure."""
    cfg.out = Path(cfg.out)
    cfg.out.mkdir(parents=True, exist_ok=True)
    with _terminate_as_interrupt():
        return _run(cfg)


def _run(cfg: DemoConfig) -> Any:
    t0 = time.monotonic()
    if cfg.servers and len(cfg.models) > 1:
        raise DemoError(f"--server serves one model; pass one of --models ({', '.join(cfg.models)}) with it")
    _say(f"kvdiv demo → {cfg.out}  ({', '.join(cfg.models)}: {cfg.docs_count} docs × "
         f"{len(demo_policies(1))} policies, "
         f"R={_replicates_text(cfg)}, T={cfg.max_new_tokens}, W={cfg.window}, residual traces)")
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
                docs_path, budget = _prepare_documents(cfg)
                plan = cfg.plan or write_demo_plan(shipped_plan(), cfg.out / "plan.toml", budget, cfg.window,
                                                   confirmatory_docs=(cfg.docs_count + 1) // 2)
                _say(f"      plan: {plan}")
            urls = list(cfg.servers) if server is None else [server.wait_ready(cfg.server_timeout_s)]
            if server is not None:
                _say(f"      server ready at {urls[0]} after {time.monotonic() - t0:.0f} s")
            _collect_part(cfg, part, urls, docs_path, budget, server, tag)
            if server is not None:
                server.stop()   # its model is done: its memory and threads go to the next
            _say(f"{tag}[4/5] packing traces.nc" + (" and reference.nc" if cfg.reference_docs else ""))
            _pack_part(cfg, part)
    traces, reference = _combined(cfg, parts)
    _say(f"[5/5] analysing with {plan}")
    an = _analyse(cfg, traces, plan, budget)
    spec = _analyse_reference(cfg, reference) if reference is not None else None
    elapsed = time.monotonic() - t0
    print(headline(an) + certify_headline(an))
    if spec is not None:
        print(speculative_headline(spec))
    print(f"\nreport: {cfg.out / 'report.html'}   summary: {cfg.out / 'summary.md'}")
    print(f"traces: {traces}   results: {cfg.out / 'results.nc'}   ({elapsed:.0f} s)")
    if spec is not None:
        print(f"speculative decoding: {spec.paths['report.html']}   reference traces: {reference}")
    return an


def _collect_part(cfg: DemoConfig, part: ModelPart, urls: list[str], docs_path: Path, budget: int,
                  server: ServerProcess | None, tag: str) -> None:
    """One model's traces: the residual set (and the control), then the reference set."""
    policies = demo_policies(budget)
    _say(f"{tag}[3/5] collecting traces: {', '.join(policies)}" + (" + the control full" if cfg.control else "")
         + (f" (template {part.template})" if part.template != cfg.template else ""))
    result = collect(CollectConfig.flat(
        servers=urls, docs_file=docs_path, policies=policies, out=part.out / "journal", kind="residual",
        replicates=part.replicates, max_new_tokens=cfg.max_new_tokens, window=cfg.window,
        temperature=1.0, seed=cfg.seed, template=part.template, api_key=cfg.api_key,
        concurrency=cfg.concurrency, progress=cfg.progress, control=cfg.control),
        stop_reason=server.exit_reason if server is not None else None)
    _say(f"      {result.summary()}")
    if not result.ok:
        gone = server.exit_reason() if server is not None else None
        raise DemoError(gone or f"{len(result.failed)} requests failed; rerun the same command to retry "
                        f"them ({part.out / 'journal'} keeps every complete request)")
    if cfg.reference_docs:
        _collect_reference(cfg, part, urls, docs_path, server)


def _pack_part(cfg: DemoConfig, part: ModelPart) -> None:
    save_dataset(pack_run(part.out / "journal", progress=False), part.out / "traces.nc", overwrite=True)
    if cfg.reference_docs:
        save_dataset(pack_run(part.out / "reference" / "journal", progress=False), part.out / "reference.nc",
                     overwrite=True)


def _combined(cfg: DemoConfig, parts: list[ModelPart]) -> tuple[Path, Path | None]:
    """The traces (and reference traces) to analyse: one model's own files, or every
    model's combined along ``model`` (named by the short ids) into ``cfg.out``."""
    reference = "reference.nc" if cfg.reference_docs else None
    if len(parts) == 1:
        return parts[0].out / "traces.nc", (parts[0].out / reference if reference else None)
    import protocols
    from collector.rounds import pad_replicates

    _say(f"      combining {', '.join(p.model for p in parts)} along model")
    names = [p.model for p in parts]
    out = {}
    for name in ("traces.nc",) + ((reference,) if reference else ()):
        sets = [protocols.open_traces(p.out / name).load() for p in parts]
        # a model studied at a smaller R holds absent replicates in the others' slots
        # (docs/contract.md): every estimate is that of its own R (residual traces only)
        width = max(ds.sizes["replicate"] for ds in sets)
        sets = [pad_replicates(ds, width) for ds in sets]
        out[name] = save_dataset(protocols.combine(sets, "model", models=names), cfg.out / name, overwrite=True)
    return out["traces.nc"], out.get(reference) if reference else None


def _analyse_reference(cfg: DemoConfig, traces: Path) -> Any:
    """The reference set's own report (``speculative/``): its Speculative decoding section.

    Descriptive (no plan: the demo prespecifies no speculative hypothesis) and without a
    cost ratio (the traces do not time the draft apart from the target), so it shows
    tokens per call against γ, not a speedup."""
    from divstats import analyze

    return analyze(traces, None, cfg.out / "speculative", seed=cfg.seed, n_resamples=cfg.n_resamples,
                   progress=False)


def speculative_headline(an: Any) -> str:
    """Tokens per target call per draft policy at each γ, with the interval over documents
    when there are enough of them (else ± the Monte Carlo standard error)."""
    spec = an.speculative
    gammas = [int(g) for g in spec["gamma"].values]
    lines = ["", f"  speculative decoding with the evicted model as draft ({int(spec['n_docs'].max())} docs): "
             "tokens per target call, 95% interval over documents"]
    models = [str(m) for m in spec["model"].values] if "model" in spec.dims else [None]
    for model in models:
        one = spec if model is None else spec.sel(model=model)
        if model is not None:
            lines.append(f"  model {model}")
        lines += _speculative_rows(one, gammas)
    return "\n".join(lines)


def _speculative_rows(spec: Any, gammas: list[int]) -> list[str]:
    lines = [f"  {'draft':<12}" + "".join(f"{'γ = ' + str(g):>20}" for g in gammas)]
    for pol in spec["policy"].values:
        cells = []
        for g in gammas:
            c = spec.sel(policy=pol, gamma=g)
            lo, hi = float(c["tokens_per_call_low"]), float(c["tokens_per_call_high"])
            band = f"[{lo:.2f}, {hi:.2f}]" if math.isfinite(lo) and math.isfinite(hi) else \
                f"± {float(c['tokens_per_call_se']):.2f}"
            cells.append(f"{float(c['tokens_per_call']):.2f} {band}")
        lines.append(f"  {str(pol):<12}" + "".join(f"{x:>20}" for x in cells))
    return lines


def _collect_reference(cfg: DemoConfig, part: ModelPart, urls: list[str], docs_path: Path,
                       server: ServerProcess | None) -> None:
    """The reference set: the first ``cfg.reference_docs`` documents, each scored by :data:`REFERENCE_POLICIES`.

    Its own journal (``reference/journal`` in the model's folder), so that a rerun resumes it like the main one.
    """
    root = part.out / "reference"
    docs = D.read_jsonl(docs_path)[:cfg.reference_docs]
    ref_docs = D.write_jsonl(docs, root / "documents.jsonl")
    _say(f"      reference traces: {len(docs)} docs × {', '.join(REFERENCE_POLICIES)}, "
         f"R={cfg.reference_r()}, T={cfg.max_new_tokens}")
    result = collect(CollectConfig.flat(
        servers=urls, docs_file=ref_docs, policies=list(REFERENCE_POLICIES), out=root / "journal",
        kind="reference", replicates=cfg.reference_r(), max_new_tokens=cfg.max_new_tokens,
        temperature=1.0, seed=cfg.seed, template=part.template, api_key=cfg.api_key,
        concurrency=cfg.concurrency, progress=cfg.progress, control=False),
        stop_reason=server.exit_reason if server is not None else None)
    _say(f"      {result.summary()}")
    if not result.ok:
        gone = server.exit_reason() if server is not None else None
        raise DemoError(gone or f"{len(result.failed)} reference requests failed; rerun the same command to "
                        f"retry them ({root / 'journal'} keeps every complete request)")
