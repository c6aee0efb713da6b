"""The Examples sections of the protocols docstrings run and print what they claim.

Also checks the package hygiene the docstrings describe: every module declares
``__all__``, every public function in it has the numpydoc sections, and every
exception class derives from :class:`protocols.ProtocolError`.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import pkgutil

import pytest

import protocols
from protocols.errors import ProtocolError

MODULES = sorted(m.name for m in pkgutil.iter_modules(protocols.__path__, "protocols."))
SECTIONS = ("Parameters", "Returns", "Raises", "Examples")


@pytest.mark.parametrize("name", ["protocols", *MODULES])
def test_examples_run(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} failing example(s) in {name}"


@pytest.mark.parametrize("name", ["protocols", *MODULES])
def test_all_is_declared_and_complete(name: str) -> None:
    module = importlib.import_module(name)
    assert hasattr(module, "__all__"), f"{name} has no __all__"
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what it does not define: {missing}"


@pytest.mark.parametrize("name", MODULES)
def test_public_functions_have_numpydoc_sections(name: str) -> None:
    module = importlib.import_module(name)
    for attr in module.__all__:
        obj = getattr(module, attr)
        func = getattr(obj, "callback", obj)       # click commands wrap the function
        if not inspect.isfunction(func) or func.__module__ != name:
            continue
        doc = inspect.getdoc(func) or ""
        if "Yields\n------" in doc:                  # a generator (or context manager) yields
            doc += "\nReturns\n-------"
        absent = [s for s in SECTIONS if f"{s}\n{'-' * len(s)}" not in doc]
        assert not absent, f"{name}.{attr}: docstring lacks {absent}"


def test_every_exception_class_is_a_protocol_error() -> None:
    for name in MODULES:
        module = importlib.import_module(name)
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, Exception) and obj.__module__.startswith("protocols"):
                assert issubclass(obj, ProtocolError), f"{obj.__module__}.{obj.__name__} is not a ProtocolError"
                if obj is not ProtocolError:
                    assert issubclass(obj, ValueError), f"{obj.__name__} lost its ValueError base"
