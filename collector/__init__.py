"""collector: the torch-free client that collects traces over HTTP.

``collect`` drives one or more trace servers and keeps an append-only journal per
run (``journal``); ``pack`` assembles a run into a ``kvdiv.trace/1`` dataset;
``documents`` builds and renders the document sets. Depends on httpx and
``protocols`` only; never imports torch, transformers, divstats or gen_service
(docs/architecture.md). Every error it raises on purpose derives from
:class:`collector.errors.CollectorError`.
"""

from collector.errors import CollectorError

__all__ = ["CollectorError"]
