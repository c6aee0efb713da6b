"""Calibration studies with known truth (coverage, size and power of the intervals and tests):
used by tests and benchmarks only; no production room imports this one.

Import from the submodules; this package exports nothing itself (docs/architecture.md).
"""

__all__: list[str] = []
