"""Trace datasets as arrays: the layout and core arrays (``arrays``), document chunking for
lazily loaded traces (``chunked``) and the per-replicate values of each trace kind
(``replicates``). Imports only ``divstats.errors``.

Import from the submodules; this package exports nothing itself (docs/architecture.md).
"""

__all__: list[str] = []
