"""The service's state (``service``), the continuous decoding batch (``batching``), memory
admission (``admission``) and the limits a request is parsed against (``limits``). Imports
``engine/`` and the rooms below it.

Import from the submodules; this package exports nothing itself (docs/architecture.md).
"""

__all__: list[str] = []
