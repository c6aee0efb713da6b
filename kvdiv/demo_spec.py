"""What ``kvdiv demo`` studies, as data: :data:`DEMO_STUDY`, and the run's settings (:class:`DemoConfig`).

The study is one frozen record (:class:`StudySpec`): the documents (source, count, length,
template), the plan, the policies (the paper's, the sweep of "How much can I compress?",
what it certifies), the models with each one's R, the horizon T and window W, the control,
the further trace sets collected beside the main one (:class:`TraceSet`: today the
reference set of speculative decoding) and the headline's columns. ``kvdiv demo``'s
options override it field by field in a :class:`DemoConfig`; the orchestration
(``kvdiv.demo``) reads only the config.

Policies, T and W are the study's, not a model's: the models' traces are combined along
``model`` (``protocols.combine``), which needs the same documents, policies, T and W on
each; a model may have its own R (a smaller one holds absent replicates in the others'
slots, docs/contract.md).

A further trace set is a row of :attr:`StudySpec.trace_sets`: its own journal and file in
each model's folder (``<name>/journal``, ``<name>.nc``), collected after the main traces
from the same server, packed and combined like them; ``kvdiv.demo`` analyses each set by
its name.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from collector import documents as D

__all__ = [
    "DEFAULT_MODELS", "DEFAULT_REPLICATES", "DEMO_STUDY", "MODEL_REPLICATES", "PLANNED_BUDGET_POLICY",
    "REFERENCE_POLICIES", "SWEEP", "DemoConfig", "DemoError", "ModelPart", "ModelRow", "StudySpec", "TraceSet",
    "budget_policy", "demo_policies", "model_slug", "template_for", "with_sweep",
]


class DemoError(RuntimeError):
    """A demo step that failed, with what to do about it."""


@dataclass(frozen=True)
class ModelRow:
    """One model of the study: its id (as ``kvdiv serve --model`` takes it) and the R of its residual traces."""

    model: str
    replicates: int


@dataclass(frozen=True)
class TraceSet:
    """A further set of traces collected beside the main residual set, on its first ``docs`` documents.

    Attributes
    ----------
    name : str
        Its folder and file in each model's folder (``<name>/journal``, ``<name>.nc``) and its name
        in the progress lines.
    kind : str
        The ``kvdiv.trace/1`` kind collected.
    policies : tuple of str
        The candidates of each document's request.
    docs : int
        The first ``docs`` documents of the study's set (0: not collected).
    replicates : int
        R, at most the smallest residual R (a set without absent replicates needs the same R on every model).
    task : str
        A task of ``kvdiv docs --task`` (collector.tasks): the set's ``docs`` documents are that task's,
        ``target_tokens`` long in the model's tokens, instead of the study's; "" for the study's.
    target_tokens : int
        The task documents' length.
    temperature : float
        The sampling temperature (0: greedy).
    max_new_tokens : int
        T; 0 for the study's.
    template : str
        The prompt template; "" for the model's.
    control : bool
        Collect the control ``full`` as a candidate too.
    models : tuple of str
        The models it is collected on; () for every model studied.
    """

    name: str
    kind: str
    policies: tuple[str, ...]
    docs: int
    replicates: int
    task: str = ""
    target_tokens: int = 0
    temperature: float = 1.0
    max_new_tokens: int = 0
    template: str = ""
    control: bool = False
    models: tuple[str, ...] = ()

    @property
    def file(self) -> str:
        return f"{self.name}.nc"

    def applies(self, model: str) -> bool:
        """Whether the set is collected on ``model``."""
        return not self.models or model in self.models


@dataclass(frozen=True)
class StudySpec:
    """The demo's study (module docstring); :data:`DEMO_STUDY` is the one ``kvdiv demo`` runs."""

    #: The document set: CPython's language reference (``pydoc_data.topics``), chunked with the first model's
    #: tokenizer to about ``target_tokens``, ``docs_count`` of them balanced over the plan's split.
    documents: str
    docs_count: int
    target_tokens: int
    template: str
    #: The shipped plan (divstats package data) the demo plan is derived from.
    plan: str
    #: The paper's policies; ``{budget}`` is N of ``snapkv#N``, half the median prompt (``kvdiv.demo_documents``).
    policies: tuple[str, ...]
    #: The sweep of "How much can I compress?": each method at these retentions, added to the policies.
    sweep: tuple[tuple[str, tuple[float, ...]], ...]
    #: What the demo plan certifies for each swept method: this metric within this margin, on all documents.
    certify_metric: str
    certify_margin: float
    models: tuple[ModelRow, ...]
    #: R of a model the table does not list.
    default_replicates: int
    max_new_tokens: int
    window: int
    #: Collect the numerical control (``full`` as a candidate, ``kvdiv collect --control``).
    control: bool
    trace_sets: tuple[TraceSet, ...]
    #: The aggregate estimands the printed headline shows per policy.
    headline_quantities: tuple[str, ...]

    def replicates_for(self, model: str) -> int:
        """R of a model's residual traces: its row's, else :attr:`default_replicates`."""
        return next((row.replicates for row in self.models if row.model == model), self.default_replicates)

    def trace_set(self, name: str) -> TraceSet:
        """The further trace set called ``name``."""
        return next(ts for ts in self.trace_sets if ts.name == name)


#: The study ``kvdiv demo`` runs. Sized to ``make demo``'s 10 minutes on 2 CPU cores, the install included:
#: 8 min 55 s were measured with both models from a fresh clone (docs/collector.md, "What the second model
#: costs"). Gemma 3 270M's step costs several times SmolLM2's on a CPU (its 262k-token head and the sampling
#: over it), so its part is sized at half the replicates. The sweep adds two candidates to each document's
#: grouped request (their prompt is shared; the demo's wall time grows by about 2/5 of collecting); the
#: control adds one (about +25% collection time, docs/collector.md, "The control"). The reference set is small
#: on purpose (one grouped request per document), yet the 10 documents that intervals over documents need
#: (``MIN_DOCS_AGGREGATE``); analysed into ``speculative/`` (docs/collector.md, "The demo").
DEMO_STUDY = StudySpec(
    documents="pydoc", docs_count=10, target_tokens=128, template="summarise", plan="paper",
    policies=("snapkv@0.5", "snapkv#{budget}", "recent@0.5", "snapkv@0.9"),
    sweep=(("snapkv", (0.9, 0.5, 0.3)), ("recent", (0.5, 0.3))),
    certify_metric="mismatch_fraction", certify_margin=0.05,
    models=(ModelRow("smollm2-135m", 4), ModelRow("gemma3-270m", 2)), default_replicates=4,
    max_new_tokens=8,
    window=7,   # W = T - 1: branches reach the horizon, so every estimand is identified
    control=True,
    trace_sets=(
        TraceSet("reference", "reference", ("snapkv@0.5", "recent@0.5"), docs=10, replicates=2),
        # Does compression change the answer? (docs/collector.md, "The demo"): pass keys near 500 tokens, the
        # needle depths spread evenly, greedy as the leaderboards, T = 12 (SmolLM2 answers "The pass key is
        # 48213." in 11 tokens), on the chat model
        TraceSet("passkey", "coupled", ("snapkv@0.5", "recent@0.5", "snapkv@0.3"), docs=30, replicates=1,
                 task="passkey", target_tokens=500, temperature=0.0, max_new_tokens=12, template="qa", control=True,
                 models=("smollm2-135m",)),
    ),
    headline_quantities=("occurrence", "rmtd", "exposure"),
)

#: The policy of the shipped plan that the demo replaces by ``snapkv#N`` (a plan alias).
PLANNED_BUDGET_POLICY = "snapkv#512"
#: The models the demo studies by default, as the paper studies two: the embedded chat model and the
#: embedded base model (gen_service.models.EMBEDDED_MODELS).
DEFAULT_MODELS: tuple[str, ...] = tuple(row.model for row in DEMO_STUDY.models)
#: Each listed model's R when ``-R`` is not given; other models get :data:`DEFAULT_REPLICATES`.
MODEL_REPLICATES: dict[str, int] = {row.model: row.replicates for row in DEMO_STUDY.models}
DEFAULT_REPLICATES = DEMO_STUDY.default_replicates
#: The sweep as a mapping: method -> retentions (docs/plans.md, "How much can I compress?").
SWEEP: dict[str, tuple[float, ...]] = dict(DEMO_STUDY.sweep)
#: The drafts the demo's reference traces score (docs/collector.md, "The demo").
REFERENCE_POLICIES = DEMO_STUDY.trace_set("reference").policies


def budget_policy(budget: int) -> str:
    """The policy that stands for the plan's :data:`PLANNED_BUDGET_POLICY`: ``snapkv#N``."""
    return f"snapkv#{budget}"


def with_sweep(policies: list[str] | tuple[str, ...]) -> list[str]:
    """``policies`` and the members of the sweep they lack (a family's budgets, in one grouped request)."""
    extra = [f"{method}@{r:g}" for method, rs in DEMO_STUDY.sweep for r in rs]
    return list(policies) + [p for p in extra if p not in policies]


def demo_policies(budget: int) -> list[str]:
    """The residual set's candidates: the study's policies with N = ``budget``, then the sweep."""
    return with_sweep([p.format(budget=budget) for p in DEMO_STUDY.policies])


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


@dataclass
class DemoConfig:
    """One run of the demo: :data:`DEMO_STUDY` with ``kvdiv demo``'s options over it, and where it runs.

    Every model gets the same documents, policies, T and W: traces combine along ``model``
    only when they agree on those; a model studied at a smaller R holds absent replicates
    in the others' slots.
    """

    out: Path = Path("runs/demo")
    docs_count: int = DEMO_STUDY.docs_count
    target_tokens: int = DEMO_STUDY.target_tokens
    #: R for every model; None: each model's own (:data:`MODEL_REPLICATES`)
    replicates: int | None = None
    max_new_tokens: int = DEMO_STUDY.max_new_tokens
    window: int = DEMO_STUDY.window
    seed: int = 0
    servers: list[str] = field(default_factory=list)
    #: the models studied, one after the other (short ids as ``kvdiv serve --model`` takes)
    models: list[str] = field(default_factory=lambda: list(DEFAULT_MODELS))
    concurrency: int = 8   # keeps the local server's queue full (a CPU server decodes one request at a time)
    api_key: str | None = None
    template: str = DEMO_STUDY.template
    plan: Path | None = None
    n_resamples: int = 2000
    progress: bool = True
    server_timeout_s: float = 900.0
    control: bool = DEMO_STUDY.control
    #: The reference set's documents (0 skips it) and R (at most the smallest residual R: :meth:`reference_r`).
    reference_docs: int = DEMO_STUDY.trace_set("reference").docs
    reference_replicates: int = DEMO_STUDY.trace_set("reference").replicates
    #: The pass-key set's documents (0 skips it).
    passkey_docs: int = DEMO_STUDY.trace_set("passkey").docs

    def sizes(self) -> dict[str, Any]:
        """The settings that decide the traces (compared on resume)."""
        out = {k: v for k, v in asdict(self).items()
               if k in ("docs_count", "target_tokens", "max_new_tokens", "window", "seed", "template", "models")}
        return {**out, "replicates": {m: self.replicates_for(m) for m in self.models}}

    def replicates_for(self, model: str) -> int:
        """R of a model's residual traces: ``replicates`` when set, else the model's own."""
        return self.replicates or DEMO_STUDY.replicates_for(model)

    def reference_r(self) -> int:
        """R of every model's reference traces: ``reference_replicates``, at most the smallest
        residual R (a model sized down for time is sized down in both sets; reference traces
        hold no absent replicates, docs/contract.md, so every model gets the same R)."""
        return min([self.reference_replicates] + [self.replicates_for(m) for m in self.models])

    def trace_sets(self) -> list[TraceSet]:
        """The further trace sets this run collects, at its sizes (those of 0 documents left out)."""
        sets = [dataclasses.replace(DEMO_STUDY.trace_set("reference"), docs=self.reference_docs,
                                    replicates=self.reference_r()),
                dataclasses.replace(DEMO_STUDY.trace_set("passkey"), docs=self.passkey_docs)]
        return [ts for ts in sets if ts.docs and any(ts.applies(m) for m in self.models)]

    def parts(self) -> list[ModelPart]:
        """One part per model: its folder (``out`` itself for a single model, as before), template and R."""
        many = len(self.models) > 1
        return [ModelPart(m, self.out / model_slug(m) if many else self.out, template_for(m, self.template),
                          self.replicates_for(m)) for m in self.models]

    def replicates_text(self) -> str:
        """R as the opening line states it: one number, or each model's."""
        rs = {m: self.replicates_for(m) for m in self.models}
        return str(next(iter(rs.values()))) if len(set(rs.values())) == 1 else \
            " / ".join(f"{r} ({m})" for m, r in rs.items())


@dataclass(frozen=True)
class ModelPart:
    """One model's part of the study: its model id, its folder (journal, traces, server
    log) and its prompt template (the raw form for a base model)."""

    model: str
    out: Path
    template: str
    replicates: int = DEFAULT_REPLICATES
