"""kvdiv: measure how and when KV-cache eviction makes generations drift.

This package holds only the ``kvdiv`` command-line entry point. The work lives in
``protocols`` (the trace contract), ``divstats`` (the statistics) and
``gen_service`` (the HTTP service and collector).
"""

__version__ = "0.1.0"
