"""Study design from a pilot: what the pilot says per hypothesis (``pilot``), power of a plan's
hypotheses (``power``) and the choice of documents and replicates, including allocation of
further replicates (``allocation``), and the documents needed to certify a budget
(``certify_power``).

Import from the submodules; this package exports nothing itself (docs/architecture.md).
"""

__all__: list[str] = []
