"""The project's module graph: no import cycle anywhere, and the application layer uses
only what divstats exports (docs/architecture.md, "The house").

Both checks read the source statically (function-level imports included), so a cycle
hidden inside a function, the old workaround, fails here as surely as a top-level one.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protocols", "divstats", "collector", "gen_service", "kvdiv")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imports(path: Path, name: str) -> Iterator[tuple[str, str | None]]:
    """(module, imported name or None) for every absolute or relative import in a file."""
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                module = ".".join(base + ([module] if module else []))
            for alias in node.names:
                yield module, alias.name


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Edges module -> project module, resolving ``from pkg import submodule`` to the submodule."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for module, imported in _imports(path, name):
            target = f"{module}.{imported}" if imported and f"{module}.{imported}" in modules else module
            while target and target not in modules:  # `import a.b.c` of a name inside a module
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_import_cycle_anywhere() -> None:
    cycles = _cycles(_graph(_modules()))
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_relative_and_submodule_imports_resolve(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("from . import sibling\nfrom .x import y\nimport pkg.sub\n")
    assert list(_imports(src, "pkg.m")) == [("pkg", "sibling"), ("pkg.x", "y"), ("pkg.sub", None)]


def _divstats_exports() -> set[str]:
    import divstats

    return set(divstats.__all__)


@pytest.mark.parametrize("package", ["kvdiv", "collector"])
def test_application_layer_uses_only_exported_divstats_names(package: str) -> None:
    exported = _divstats_exports()
    offences = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for module, imported in _imports(path, _module_name(path)):
            where = path.relative_to(ROOT)
            if module.startswith("divstats."):
                offences.append(f"{where} imports the internal module {module}")
            elif module == "divstats" and imported is not None and imported not in exported:
                offences.append(f"{where} imports divstats.{imported}, which divstats does not export")
    assert not offences, "\n".join(offences)
