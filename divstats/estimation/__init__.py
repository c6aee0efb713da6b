"""Estimators on traces: per-(doc, policy) estimates and their aggregates (``estimators``), curves
(``curves``), the sharp interval (``interval``), the variance check (``variance``), variance
components (``components``), the intervals over documents (``resample``), policy families (``sweeps``)
and the fidelity-against-budget curves with their simultaneous band (``budget_curves``). Imports only
``traces`` (and ``divstats.errors``).

Import from the submodules; this package exports nothing itself (docs/architecture.md).
"""

__all__: list[str] = []
