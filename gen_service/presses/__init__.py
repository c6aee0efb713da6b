"""kvpress policies: the registry (``registry``), press traits (``traits``), parameters (``params``),
trained artifacts (``artifacts``), the catalog (``catalog``), quantized caches (``quantized``) and
their torch-free settings (``kivi``).
Imports ``attention/``, ``models/`` (neither today) and ``errors``.

Import from the submodules; this package exports nothing itself (docs/architecture.md).
"""

__all__: list[str] = []
