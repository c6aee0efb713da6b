"""Hygiene of the service modules of the HTTP layer: ``__all__`` complete, numpydoc
sections on every public function, examples that run, every exception a ServiceError."""

from __future__ import annotations

import doctest
import importlib
import inspect

import pytest

from gen_service.errors import ServiceError

MODULES = ["gen_service.api.app", "gen_service.api.body", "gen_service.engine.coupling", "gen_service.errors",
           "gen_service.api.handlers", "gen_service.api.records", "gen_service.api.cli", "gen_service.serving.service",
           "gen_service.serving.limits", "gen_service.serving.intake", "gen_service.api.openai_wire",
           "gen_service.api.tgi_wire"]
SECTIONS = ("Parameters", "Returns", "Raises", "Examples")


@pytest.mark.parametrize("name", MODULES)
def test_all_declared_documented_and_examples_run(name: str) -> None:
    module = importlib.import_module(name)
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what it does not define: {missing}"
    for attr in module.__all__:
        obj = getattr(module, attr)
        if not inspect.isfunction(obj) or obj.__module__ != name:
            continue  # classes, constants, re-exports; click commands document themselves as CLI help
        doc = inspect.getdoc(obj) or ""
        absent = [s for s in SECTIONS if f"{s}\n{'-' * len(s)}" not in doc]
        assert not absent, f"{name}.{attr}: docstring lacks {absent}"
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} failing example(s) in {name}"


def test_every_service_exception_is_a_service_error() -> None:
    for name in [*MODULES, "gen_service.engine.jobs", "gen_service.presses.registry"]:
        module = importlib.import_module(name)
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, Exception) and obj.__module__.startswith("gen_service"):
                assert issubclass(obj, ServiceError), f"{obj.__module__}.{obj.__name__} is not a ServiceError"
