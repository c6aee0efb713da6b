"""The click commands ``kvdiv analyze``/``kvdiv split`` (``analyze``) and ``kvdiv power``
(``power``), mapped by kvdiv/cli.py.

Import from the submodules; this package exports nothing itself (docs/architecture.md).
"""

__all__: list[str] = []
