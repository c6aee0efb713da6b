"""divstats: estimators of how KV-cache eviction makes generations drift (docs/statistics.md).

The contract is docs/statistics.md; every estimand there has an exact enumerator
(``exact``), a simulator producing trace datasets (``simulate``) and estimators
for each trace kind (``estimate``, ``survival``, ``branch_tv``, ``sharp_interval``).
Comparisons between policies (``decompose``, ``paired_test``) and prespecified
plans (``load_plan``, ``run_plan``) sit on top. ``analyze`` (the report) is loaded
lazily because it pulls in matplotlib. Every exception divstats raises on purpose
is a :class:`DivstatsError`.
"""

from divstats.coupling import simulate
from divstats.curves import branch_tv, branch_tv_window, survival
from divstats.decompose import DecompositionResult, decompose
from divstats.errors import DivstatsError, NotIdentified, OutputError, PlanError
from divstats.estimators import aggregate, aggregate_intervals, estimate
from divstats.exact import ExactResult, exact
from divstats.interval import extremal_kernels, interval_by_window, sharp_interval
from divstats.paired import holm, paired_test
from divstats.planrun import PlanResult, run_plan
from divstats.plans import Plan, assign_split, load_plan, shipped_plan, shipped_plans
from divstats.variance import variance_check

__all__ = [
    "DecompositionResult", "DivstatsError", "ExactResult", "NotIdentified", "OutputError", "Plan", "PlanError",
    "PlanResult", "aggregate", "aggregate_intervals", "analyze", "assign_split", "branch_tv", "branch_tv_window",
    "decompose", "estimate", "exact", "extremal_kernels", "holm", "interval_by_window", "load_plan",
    "paired_test", "run_plan", "shipped_plan", "shipped_plans", "sharp_interval", "simulate", "survival",
    "variance_check",
]


def __getattr__(name: str):
    if name == "analyze":
        from divstats.report import analyze

        return analyze
    raise AttributeError(f"module 'divstats' has no attribute {name!r}")
