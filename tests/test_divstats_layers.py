"""divstats' rooms (docs/architecture.md, "divstats: rooms by job"): what each room may
import, checked statically over every file of the package, function-level and
``TYPE_CHECKING`` imports included; no module imports from the package root or from a
room's ``__init__``, and functions and classes come from the module that defines them;
function-level imports only for deliberate, commented lazy loads; and no import cycle
between divstats modules.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "divstats"

#: Base modules every room may import (``divstats.errors``, the estimand table, the interval type).
BASE = {"errors", "estimands", "intervals"}
#: room -> the other rooms it may import (every room may import itself and the BASE modules).
ALLOWED: dict[str, set[str]] = {
    "truth": set(),
    "traces": set(),
    "estimation": {"traces"},
    "inference": {"estimation", "traces"},
    "plans": {"inference", "estimation", "traces"},
    "design": {"plans", "inference", "estimation", "traces", "truth"},
    "calibration": {"design", "plans", "inference", "estimation", "traces", "truth"},
    "report": {"design", "plans", "inference", "estimation", "traces", "truth"},
    "cli": {"report", "design", "plans", "inference", "estimation", "traces", "truth"},
    "errors": set(),
    "estimands": set(),
    "intervals": set(),
    # The package root re-exports the public names of the production rooms (the report lazily).
    "root": {"report", "design", "plans", "inference", "estimation", "traces", "truth"},
}
ROOMS = {r for r in ALLOWED if r not in BASE | {"root"}}
#: Production rooms: none of them may import calibration/ (ALLOWED already says so; kept explicit).
PRODUCTION = set(ALLOWED) - {"calibration"}

#: Heavy third-party packages a function may import lazily (with a comment saying why).
LAZY_THIRD_PARTY = {"matplotlib", "arviz", "statsmodels", "jinja2", "tqdm", "dask"}
#: Rooms that may load the report room lazily inside a function (the CLI, the root's ``analyze``).
LAZY_REPORT_LOADERS = {"cli", "root"}


@dataclass(frozen=True)
class Import:
    """One import statement: the modules it names, where, and how it is guarded."""

    target: str            # the imported module (``divstats.x.y`` resolved to a module where it is one)
    line: int
    nested: bool           # inside a function
    commented: bool        # a comment on its line or above its run of imports
    from_package: bool     # ``from divstats[.room] import name`` with name not a module


def module_name(path: Path, package_dir: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def room_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "root"
    return parts[1]


def _is_package(name: str, package_dir: Path) -> bool:
    return (package_dir.joinpath(*name.split(".")[1:]) / "__init__.py").is_file()


def _is_module(name: str, package_dir: Path) -> bool:
    base = package_dir.joinpath(*name.split(".")[1:])
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _targets(node: ast.Import | ast.ImportFrom, package_dir: Path) -> list[tuple[str, bool]]:
    """(module, imported from a package's __init__) for each name an import statement binds."""
    top = package_dir.name
    if isinstance(node, ast.Import):
        return [(alias.name, alias.name == top) for alias in node.names]
    if node.level:
        return [("." * node.level + (node.module or ""), False)]
    mod = node.module or ""
    if mod.split(".")[0] != top or not _is_package(mod, package_dir):
        return [(mod, False)]
    # ``from divstats[.room] import x``: a submodule x, or a name of the package's __init__
    return [(f"{mod}.{a.name}", False) if _is_module(f"{mod}.{a.name}", package_dir) else (mod, True)
            for a in node.names]


def imports(path: Path, package_dir: Path = PACKAGE) -> list[Import]:
    """Every import in a file (module level, under ``if``, inside functions)."""
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    found: list[Import] = []

    def commented(lineno: int) -> bool:
        """A comment on the line, or above the run of import lines it belongs to."""
        if "#" in lines[lineno - 1]:
            return True
        k = lineno - 2
        while k >= 0 and lines[k].strip().startswith(("from ", "import ")):
            k -= 1
        return k >= 0 and lines[k].strip().startswith("#")

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend(Import(target, child.lineno, nested, commented(child.lineno), from_package)
                             for target, from_package in _targets(child, package_dir))
            visit(child, nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source, filename=str(path)), False)
    return found


def files(package_dir: Path = PACKAGE) -> list[Path]:
    return sorted(package_dir.rglob("*.py"))


def graph(package_dir: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the divstats modules it imports (any depth, ``TYPE_CHECKING`` included)."""
    top = package_dir.name
    out: dict[str, set[str]] = {}
    for path in files(package_dir):
        out[module_name(path, package_dir)] = {i.target for i in imports(path, package_dir)
                                               if i.target.split(".")[0] == top}
    return out


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (or a self-import)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan; the graph is a few dozen modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in edges.get(v, ()):
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strongconnect(v)
    return found


def offences(package_dir: Path = PACKAGE) -> list[str]:
    top = package_dir.name
    bad: list[str] = []
    for path in files(package_dir):
        mod = module_name(path, package_dir)
        room = room_of(mod)
        where = path.relative_to(package_dir.parent)
        if room not in ALLOWED:
            bad.append(f"{where}: not in a room ({', '.join(sorted(ROOMS))})")
            continue
        for imp in imports(path, package_dir):
            at = f"{where}:{imp.line}"
            if imp.target.startswith("."):
                bad.append(f"{at}: relative import {imp.target}")
                continue
            is_ours = imp.target.split(".")[0] == top
            if is_ours:
                target_room = room_of(imp.target)
                if imp.from_package:
                    what = "the package root" if imp.target == top else f"the package {imp.target}"
                    bad.append(f"{at}: imports from {what}; import from the submodule that defines the name")
                elif target_room == "root":
                    bad.append(f"{at}: imports the package root")
                elif target_room not in {room} | BASE and target_room not in ALLOWED[room]:
                    bad.append(f"{at}: {room}/ may not import {target_room}/ ({imp.target})")
            if imp.nested:
                lazy_report = is_ours and room in LAZY_REPORT_LOADERS and room_of(imp.target) == "report"
                lazy_heavy = not is_ours and imp.target.split(".")[0] in LAZY_THIRD_PARTY
                if not (lazy_report or lazy_heavy):
                    bad.append(f"{at}: function-level import of {imp.target}; import it at module level")
                elif not imp.commented:
                    bad.append(f"{at}: lazy import of {imp.target} without a comment saying why")
    return bad


def test_every_file_respects_the_rooms():
    found = offences()
    assert not found, "\n".join(found)


def test_no_production_room_imports_calibration():
    edges = graph()
    bad = [f"{m} imports {t}" for m, ts in edges.items() for t in ts
           if room_of(m) in PRODUCTION and room_of(t) == "calibration"]
    assert not bad, bad


def test_no_import_cycle_between_divstats_modules():
    found = cycles(graph())
    assert not found, found


def test_the_rooms_are_a_dag():
    assert not cycles({r: ALLOWED[r] - {r} for r in ALLOWED})


def test_every_room_is_a_package_that_exports_nothing():
    for room in ROOMS:
        init = PACKAGE / room / "__init__.py"
        assert init.is_file(), f"divstats/{room}/ has no __init__.py"
        tree = ast.parse(init.read_text(encoding="utf-8"))
        assert not [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))], init


def test_functions_and_classes_are_imported_from_the_module_that_defines_them():
    import importlib
    import inspect

    bad = []
    for path in files():
        if path == PACKAGE / "__init__.py":
            continue  # the root re-exports on purpose
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("divstats.")):
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                obj = getattr(module, alias.name, None)
                if (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__ != node.module:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {alias.name} from {node.module}, "
                               f"defined in {obj.__module__}")
    assert not bad, "\n".join(bad)

# --------------------------------------------------------------------------- the checker itself

def _package(tmp_path: Path, sources: dict[str, str]) -> Path:
    pkg = tmp_path / "divstats"
    for rel, text in {"__init__.py": "", "errors.py": "", **sources}.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for room in {Path(rel).parts[0] for rel in sources if "/" in rel}:
        (pkg / room / "__init__.py").touch()
    return pkg


def test_the_checker_sees_lazy_cross_room_and_root_imports(tmp_path):
    pkg = _package(tmp_path, {
        "traces/arrays.py": "from divstats.errors import DivstatsError\n",
        "estimation/est.py": "def f():\n    from divstats.inference.paired import holm\n",
        "inference/paired.py": "from divstats import estimate\nfrom divstats.estimation import est\n",
        "truth/sim.py": "def f():\n    import matplotlib  # lazy: heavy\n    import scipy\n",
        "report/r.py": "from divstats.calibration import x\n",
    })
    found = "\n".join(offences(pkg))
    assert "estimation/ may not import inference/" in found
    assert "function-level import of divstats.inference.paired" in found
    assert "imports from the package root" in found
    assert "function-level import of scipy" in found and "matplotlib" not in found
    assert "report/ may not import calibration/" in found
    assert "traces/arrays.py" not in found and "from divstats.estimation import est" not in found


def test_the_checker_finds_cycles(tmp_path):
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    pkg = _package(tmp_path, {"report/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                             "    from divstats.report.b import B\n",
                              "report/b.py": "from divstats.report.a import A\n"})
    assert cycles(graph(pkg)) == [["divstats.report.a", "divstats.report.b"]]


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_allowed_names_only_rooms(room):
    assert ALLOWED[room] <= set(ALLOWED) - {"root"}
