"""gen_service's rooms (docs/architecture.md, "gen_service: rooms by job"): what each room
may import, checked statically over every file of the package, function-level and
``TYPE_CHECKING`` imports included; no module imports from the package root or from a
room's ``__init__`` (which export nothing); and no import cycle between gen_service modules.

Imports run one way: api -> serving -> engine -> presses -> attention -> models, and every
room may import the base module ``gen_service.errors``. Unlike divstats, function-level
imports are allowed: the server loads torch, transformers and kvpress lazily so that
``kvdiv --help`` and ``import gen_service`` stay light (tests/test_cli_imports.py); the
rooms apply to them all the same. The parsing helpers are divstats' layers test's.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from test_divstats_layers import cycles, files, graph, imports, module_name, room_of

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gen_service"

#: The base module every room may import (the one errors module).
BASE = {"errors"}
#: The rooms, top to bottom: each may import itself, the rooms after it and BASE.
ORDER = ("api", "serving", "engine", "presses", "attention", "models")
ALLOWED: dict[str, set[str]] = {room: set(ORDER[i + 1:]) for i, room in enumerate(ORDER)}
ALLOWED |= {"errors": set(), "root": set()}  # the package root imports nothing (no torch on import)
ROOMS = set(ORDER)


def offences(package_dir: Path = PACKAGE) -> list[str]:
    top = package_dir.name
    bad: list[str] = []
    for path in files(package_dir):
        mod = module_name(path, package_dir)
        room = room_of(mod)
        where = path.relative_to(package_dir.parent)
        if room not in ALLOWED:
            bad.append(f"{where}: not in a room ({', '.join(ORDER)})")
            continue
        for imp in imports(path, package_dir):
            at = f"{where}:{imp.line}"
            if imp.target.startswith("."):
                bad.append(f"{at}: relative import {imp.target}")
                continue
            if imp.target.split(".")[0] != top:
                continue
            target_room = room_of(imp.target)
            if imp.from_package:
                what = "the package root" if imp.target == top else f"the package {imp.target}"
                bad.append(f"{at}: imports from {what}; import from the submodule that defines the name")
            elif target_room == "root":
                bad.append(f"{at}: imports the package root")
            elif target_room not in {room} | BASE and target_room not in ALLOWED[room]:
                bad.append(f"{at}: {room}/ may not import {target_room}/ ({imp.target})")
    return bad


def test_every_file_respects_the_rooms():
    found = offences()
    assert not found, "\n".join(found)


def test_no_import_cycle_between_gen_service_modules():
    found = cycles(graph(PACKAGE))
    assert not found, found


def test_the_rooms_are_a_dag():
    assert not cycles({r: ALLOWED[r] - {r} for r in ALLOWED})


def test_every_room_is_a_package_that_exports_nothing():
    for room in ROOMS:
        init = PACKAGE / room / "__init__.py"
        assert init.is_file(), f"gen_service/{room}/ has no __init__.py"
        tree = ast.parse(init.read_text(encoding="utf-8"))
        assert not [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))], init
    root = ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    assert not [n for n in root.body if isinstance(n, (ast.Import, ast.ImportFrom))]


def test_every_module_is_in_a_room_or_the_base():
    top_level = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert top_level == BASE, f"modules outside the rooms: {sorted(top_level - BASE)}"


def test_the_rooms_table_in_the_docs_lists_every_module():
    """docs/architecture.md's table names each room's modules, so the doc cannot fall behind."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("### gen_service: rooms by job", 1)[1].split("\n#", 1)[0]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)/` \| (.*?) \|", section, re.M)}
    assert set(rows) == ROOMS
    for room in ROOMS:
        modules = {p.stem for p in (PACKAGE / room).glob("*.py")} - {"__init__"}
        listed = set(re.findall(r"`(\w+)`", rows[room]))
        assert modules <= listed, f"{room}/: {sorted(modules - listed)} missing from the table"

# --------------------------------------------------------------------------- the checker itself

def _package(tmp_path: Path, sources: dict[str, str]) -> Path:
    pkg = tmp_path / "gen_service"
    for rel, text in {"__init__.py": "", "errors.py": "", **sources}.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for room in {Path(rel).parts[0] for rel in sources if "/" in rel}:
        (pkg / room / "__init__.py").touch()
    return pkg


def test_the_checker_catches_a_planted_upward_import(tmp_path):
    pkg = _package(tmp_path, {
        "serving/service.py": "from gen_service.errors import ApiError\n",
        "attention/cascade.py": "from gen_service.serving.service import Service\n",   # upward
        "engine/facade.py": "def f():\n    from gen_service.api.app import create_app\n",  # upward, lazily
        "api/app.py": "from gen_service.engine import facade\nfrom gen_service.serving.service import X\n",
        "presses/registry.py": "from gen_service.engine import Engine\n",  # from a room's __init__
        "models/loading.py": "from . import float_head\n",
        "stray.py": "",
    })
    found = "\n".join(offences(pkg))
    assert "attention/ may not import serving/" in found
    assert "engine/ may not import api/" in found
    assert "imports from the package gen_service.engine" in found
    assert "relative import" in found
    assert "gen_service/stray.py: not in a room" in found
    assert "api/app.py" not in found and "serving/service.py" not in found


def test_the_checker_finds_cycles(tmp_path):
    pkg = _package(tmp_path, {"engine/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                             "    from gen_service.engine.b import B\n",
                              "engine/b.py": "from gen_service.engine.a import A\n"})
    assert cycles(graph(pkg)) == [["gen_service.engine.a", "gen_service.engine.b"]]


@pytest.mark.parametrize("room", ORDER)
def test_a_room_may_import_only_lower_rooms(room):
    assert ALLOWED[room] == set(ORDER[ORDER.index(room) + 1:])
