"""Attention and caches: the shared prompt (``shared_cache``), cascade attention (``cascade``) and
per-head masks (``head_masks``). Imports ``models/`` (not today) and ``errors``.

Import from the submodules; this package exports nothing itself (docs/architecture.md).
"""

__all__: list[str] = []
