"""Comparisons between policies: paired tests and Holm (``paired``) the gap decomposition
(``decompose``) and the certified budget of a policy family (``certify``). Imports ``estimation`` and ``traces``.

Import from the submodules; this package exports nothing itself (docs/architecture.md).
"""

__all__: list[str] = []
