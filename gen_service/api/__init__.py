"""The HTTP API: the app and its routes (``app``, ``handlers``), request records and their parsers
(``records``), reading a body safely (``body``), TGI's and OpenAI's wire formats (``tgi_wire``,
``openai_wire``) and ``kvdiv serve`` (``cli``). Imports every lower room.

Import from the submodules; this package exports nothing itself (docs/architecture.md).
"""

__all__: list[str] = []
