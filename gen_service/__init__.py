"""gen_service: the torch trace server (TGI and OpenAI-compatible API, trace streaming, kvpress policies).

Imports ``protocols`` only among kvdiv's packages; never ``divstats``, ``collector`` or
``kvdiv`` (docs/architecture.md). The package itself exports nothing, so that importing
it stays free of torch: use the modules (``gen_service.api.cli.build_service``,
``gen_service.engine.facade.Engine``, ``gen_service.presses.registry.PolicyRegistry``, ...).
"""

__all__: list[str] = []
