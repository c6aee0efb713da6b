"""kvdiv: measure how and when KV-cache eviction makes generations drift.

The distribution holds five packages, one job each (docs/architecture.md):

- ``protocols``: the ``kvdiv.trace/1`` contract;
- ``divstats``: the statistics over trace datasets;
- ``collector``: the torch-free HTTP client that collects traces;
- ``gen_service``: the torch trace server;
- ``kvdiv``: this application layer, the ``kvdiv`` command and the study (``demo``),
  the only place that joins the others.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvdiv")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
