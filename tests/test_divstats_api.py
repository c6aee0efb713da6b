"""divstats' public surface: ``__all__`` everywhere, numpydoc on every exported function,
no private name imported across modules, and every docstring example runs."""

from __future__ import annotations

import ast
import doctest
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import divstats

ROOT = Path(__file__).resolve().parents[1]
# Every module of every room (divstats/<room>/<module>.py) and the rooms themselves.
MODULES = sorted(m.name for m in pkgutil.walk_packages(divstats.__path__, "divstats."))


def _section(doc: str, name: str) -> bool:
    return re.search(rf"^{name}\n-{{3,}}", doc, re.M) is not None


def _exported_functions(mod) -> list:
    return [obj for obj in (getattr(mod, n) for n in mod.__all__)
            if inspect.isfunction(obj) and obj.__module__ == mod.__name__]


@pytest.mark.parametrize("name", ["divstats", *MODULES])
def test_every_module_declares_what_it_exports(name):
    mod = importlib.import_module(name)
    assert isinstance(getattr(mod, "__all__", None), list), f"{name} has no __all__"
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not missing, f"{name}.__all__ names what it lacks: {missing}"


@pytest.mark.parametrize("name", MODULES)
def test_every_exported_function_has_numpydoc_sections(name):
    problems = []
    for fn in _exported_functions(importlib.import_module(name)):
        doc = inspect.getdoc(fn) or ""
        sig = inspect.signature(fn)
        wanted = ["Examples"]
        if sig.parameters:
            wanted.append("Parameters")
        if sig.return_annotation not in ("None", None):
            wanted.append("Returns")
        if re.search(r"^\s+raise [A-Z]", inspect.getsource(fn), re.M):
            wanted.append("Raises")
        problems += [f"{fn.__name__}: no {s}" for s in wanted if not _section(doc, s)]
    assert not problems, problems


def _private_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("divstats"):
            if any(part.startswith("_") for part in node.module.split(".")):
                found.append(f"{path.name}:{node.lineno} from {node.module}")
            found += [f"{path.name}:{node.lineno} {a.name}" for a in node.names if a.name.startswith("_")]
    return found


def test_no_private_divstats_name_is_imported_across_modules():
    files = [*ROOT.glob("divstats/**/*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("benchmarks/*.py"),
             *ROOT.glob("kvdiv/*.py")]
    found = [f for p in files for f in _private_imports(p)]
    assert not found, found


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
