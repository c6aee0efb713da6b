"""divstats: estimators of how KV-cache eviction makes generations drift (docs/statistics.md).

The contract is METHOD.md; every estimand there has an exact enumerator
(``exact``), a simulator producing trace datasets (``simulate``) and estimators
for each trace kind (``estimate``, ``survival``, ``branch_tv``, ``sharp_interval``).
"""

from divstats.coupling import simulate
from divstats.curves import branch_tv, branch_tv_window, survival
from divstats.estimators import aggregate, estimate
from divstats.exact import ExactResult, exact
from divstats.interval import extremal_kernels, interval_by_window, sharp_interval
from divstats.variance import variance_check

__all__ = [
    "ExactResult", "aggregate", "branch_tv", "branch_tv_window", "estimate", "exact",
    "extremal_kernels", "interval_by_window", "sharp_interval", "simulate", "survival",
    "variance_check",
]
