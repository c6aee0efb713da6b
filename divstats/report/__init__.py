"""The report: ``analysis`` (``compute`` and the frozen ``Analysis``), ``results`` (results.nc),
``tables`` (with the sections' ``floor_tables``, ``compression_tables``), ``figures``, ``render``
(HTML and Markdown) and ``write`` (``analyze`` and the safe writers).

Import from the submodules; this package exports nothing itself (docs/architecture.md).
"""

__all__: list[str] = []
