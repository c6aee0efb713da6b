"""The known truth: Markov kernel pairs (``kernels``), the exact enumerator (``exact``), the trace
simulator (``simulate``), the extremal construction of the sharp interval (``extremal``) and
simulated studies with planted effects (``studies``). Imports nothing of divstats.

Import from the submodules; this package exports nothing itself (docs/architecture.md).
"""

__all__: list[str] = []
