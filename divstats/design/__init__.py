"""Study design from a pilot: power of a plan's hypotheses (``power``) and the choice of documents
and replicates, including allocation of further replicates (``allocation``).

Import from the submodules; this package exports nothing itself (docs/architecture.md).
"""

__all__: list[str] = []
