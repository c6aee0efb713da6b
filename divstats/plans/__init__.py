"""Prespecified analysis plans: the format and the shipped plans (``format``), the document
split (``split``) and running a plan on traces (``run``). Imports ``inference``, ``estimation`` and ``traces``.

Import from the submodules; this package exports nothing itself (docs/architecture.md).
"""

__all__: list[str] = []
