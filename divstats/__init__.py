"""divstats: estimators of how KV-cache eviction makes generations drift (docs/statistics.md).

The contract is docs/statistics.md; every estimand there has an exact enumerator
(``exact``), a simulator producing trace datasets (``simulate``) and estimators
for each trace kind (``estimate``, ``survival``, ``branch_tv``, ``sharp_interval``).
Comparisons between policies (``decompose``, ``paired_test``), the task answers'
paired statistics (``compare_answers``, docs/statistics.md §12) and prespecified
plans (``load_plan``, ``run_plan``) and the round planning of an adaptive
collection (``plan_round``) sit on top. Every estimand is a row of ``ESTIMANDS``;
every interval a result returns is a ``ConfidenceInterval(low, high)``. The modules live in rooms by job
(``truth``, ``traces``, ``estimation``, ``inference``, ``plans``, ``design``,
``calibration``, ``report``, ``cli``; docs/architecture.md gives what each may
import); this package re-exports the public names. ``analyze`` (the report) is loaded
lazily because it pulls in matplotlib. Every exception divstats raises on purpose
is a :class:`DivstatsError`.
"""

from divstats.design.allocation import design
from divstats.design.power import power
from divstats.design.rounds import RoundPlan, counted_replicates, plan_round
from divstats.errors import DivstatsError, NotIdentified, OutputError, PlanError
from divstats.estimands import ANSWER_ESTIMANDS, ESTIMANDS, SPECULATIVE_ESTIMANDS, Estimand
from divstats.estimation.answers import answer_values
from divstats.estimation.bounded import betting_interval, bounded_mean_interval
from divstats.estimation.budget_curves import budget_curves
from divstats.estimation.components import variance_components
from divstats.estimation.curves import branch_tv, branch_tv_window, logit_curves, survival
from divstats.estimation.estimators import aggregate, aggregate_intervals, estimate
from divstats.estimation.interval import interval_by_window, sharp_interval
from divstats.estimation.noise_floor import noise_floor
from divstats.estimation.resample import MIN_DOCS_MEAN_BOUND
from divstats.estimation.speculative import aggregate_speculative, speculative
from divstats.estimation.sweeps import kv_kept, sweep_families
from divstats.estimation.variance import variance_check
from divstats.inference.answers import (
    AnswersResult,
    CouplingSaving,
    accuracy_by_depth,
    change_by_divergence,
    compare_answers,
    compare_answers_dataset,
    coupling_saving,
)
from divstats.inference.certify import CertifyResult, certify_budget, certify_family
from divstats.inference.decompose import DecompositionResult, decompose
from divstats.inference.multiplicity import holm
from divstats.inference.paired import paired_test
from divstats.inference.results import Effect, PairedTestResult
from divstats.intervals import ConfidenceInterval
from divstats.plans.format import Plan, assign_split, load_plan, shipped_plan, shipped_plans
from divstats.plans.run import PlanResult, run_plan
from divstats.report.answer_tables import answers_text_table
from divstats.report.headline import certify_headline, headline, speculative_headline
from divstats.truth.exact import ExactResult, exact
from divstats.truth.extremal import extremal_kernels
from divstats.truth.simulate import simulate
from divstats.truth.speculative import SpeculativeExact, SpeculativeRuns, exact_target_calls, simulate_speculative
from divstats.truth.studies import PolicyEffect, markov_kernels, simulate_study

__all__ = [
    "ANSWER_ESTIMANDS", "AnswersResult", "CouplingSaving", "accuracy_by_depth", "answer_values", "change_by_divergence",
    "compare_answers", "compare_answers_dataset", "coupling_saving",
    "CertifyResult", "budget_curves", "certify_budget", "certify_family", "kv_kept", "sweep_families",
    "ConfidenceInterval", "DecompositionResult", "DivstatsError", "ESTIMANDS", "Effect", "Estimand", "ExactResult",
    "MIN_DOCS_MEAN_BOUND", "NotIdentified", "OutputError", "PairedTestResult", "Plan", "PlanError", "PlanResult",
    "PolicyEffect", "RoundPlan", "SPECULATIVE_ESTIMANDS", "SpeculativeExact", "SpeculativeRuns", "aggregate",
    "aggregate_intervals", "aggregate_speculative", "analyze", "assign_split", "betting_interval",
    "bounded_mean_interval", "branch_tv", "branch_tv_window",
    "counted_replicates", "decompose", "design", "estimate", "exact", "exact_target_calls", "extremal_kernels", "holm",
    "interval_by_window", "load_plan", "logit_curves", "markov_kernels", "noise_floor", "paired_test", "plan_round",
    "power", "run_plan", "sharp_interval", "shipped_plan", "shipped_plans", "simulate", "simulate_speculative",
    "simulate_study", "speculative", "survival", "variance_check", "variance_components",
    "certify_headline", "headline", "speculative_headline", "answers_text_table",
]


def __getattr__(name: str):
    if name == "analyze":
        from divstats.report.write import analyze  # lazy: the report pulls in matplotlib

        return analyze
    raise AttributeError(f"module 'divstats' has no attribute {name!r}")
