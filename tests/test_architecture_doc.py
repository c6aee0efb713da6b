"""docs/architecture.md's module tree lists every module of the five packages, and only those."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protocols", "divstats", "collector", "gen_service", "kvdiv")
MARK = "<!-- module-tree"


def _listed() -> set[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text[text.index(MARK):].split("```")[1]
    paths, package = set(), None
    for line in block.splitlines():
        m = re.match(r"^(\S+)/\s", line)
        if m:
            package = m.group(1)
        elif line.startswith("  ") and line.split():
            paths.add(f"{package}/{line.split()[0]}")
    return paths


def _on_disk() -> set[str]:
    found = set()
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            # a room's __init__ only says what the room holds; the tree names the room's modules
            if path.name == "__init__.py" and path.parent != ROOT / pkg and pkg == "divstats":
                continue
            found.add(rel)
    return found


def test_the_tree_lists_every_module() -> None:
    listed, disk = _listed(), _on_disk()
    assert not disk - listed, f"modules missing from docs/architecture.md's tree: {sorted(disk - listed)}"
    assert not listed - disk, f"docs/architecture.md lists modules that do not exist: {sorted(listed - disk)}"


def test_the_parser_reads_the_block() -> None:
    listed = _listed()
    assert {"protocols/kinds.py", "divstats/truth/exact.py", "gen_service/engine/facade.py"} <= listed
