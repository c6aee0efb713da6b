"""Model loading (``loading``) and float32 logits (``float_head``). Imports only ``errors``.

Import from the submodules; this package exports nothing itself (docs/architecture.md).
"""

__all__: list[str] = []
