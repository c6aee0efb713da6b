"""Prespecified analysis plans: the format, the shipped plans and the split (``format``) and
running a plan on traces (``run``). Imports ``inference``, ``estimation`` and ``traces``.

Import from the submodules; this package exports nothing itself (docs/architecture.md).
"""

__all__: list[str] = []
