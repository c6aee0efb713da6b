"""The intake (``intake``: every check a request meets, its policies built once, its memory and
time sized), the service's state (``service``), the continuous decoding batch (``batching``),
memory admission (``admission``), the limits a request is parsed against (``limits``) and the
start-up self-check (``self_check``). Imports ``engine/`` and the rooms below it.

Import from the submodules; this package exports nothing itself (docs/architecture.md).
"""

__all__: list[str] = []
