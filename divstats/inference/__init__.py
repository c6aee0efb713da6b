"""Comparisons between policies: paired tests and Holm (``paired``) and the gap decomposition
(``decompose``). Imports ``estimation`` and ``traces``.

Import from the submodules; this package exports nothing itself (docs/architecture.md).
"""

__all__: list[str] = []
