"""Comparisons between policies: paired tests (``paired_test`` in ``paired``; the tests, effect
sizes, refusals, tests at a margin and Holm in the modules beside it, docs/architecture.md), the
gap decomposition (``decompose``) and the certified budget of a policy family (``certify``).
Imports ``estimation`` and ``traces``.

Import from the submodules; this package exports nothing itself (docs/architecture.md).
"""

__all__: list[str] = []
