"""The package layers (docs/architecture.md): what each package may import, checked
statically over every source file, and the torch-free commands run with torch,
transformers and kvpress made unimportable.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from test_collector_support import FakeServer

ROOT = Path(__file__).resolve().parents[1]

# The model stack, which only the server may use.
MODEL_STACK = {"torch", "transformers", "kvpress", "tokenizers", "accelerate", "gguf", "safetensors"}
SERVER_STACK = MODEL_STACK | {"starlette", "uvicorn", "prometheus_client"}
STATS_STACK = {"scipy", "statsmodels", "arviz", "matplotlib", "jinja2"}

# package -> modules it must never import (at any depth, lazily or not).
FORBIDDEN: dict[str, set[str]] = {
    "protocols": {"divstats", "collector", "gen_service", "kvdiv", "httpx"} | SERVER_STACK | STATS_STACK,
    "divstats": {"collector", "gen_service", "kvdiv", "httpx"} | SERVER_STACK,
    "collector": {"divstats", "gen_service", "kvdiv"} | SERVER_STACK | STATS_STACK,
    "gen_service": {"divstats", "collector", "kvdiv"},
}


def _imported_roots(path: Path) -> set[str]:
    """Top-level names of every absolute import in a file, function-level ones included."""
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_respect_the_layers(package: str) -> None:
    offences = []
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = _imported_roots(path) & FORBIDDEN[package]
        if bad:
            offences.append(f"{path.relative_to(ROOT)} imports {', '.join(sorted(bad))}")
    assert not offences, "\n".join(offences)


def test_the_checker_sees_lazy_imports(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from torch import nn\n    import httpx.client\n")
    assert _imported_roots(src) == {"torch", "httpx"}


# A subprocess in which the model stack cannot be imported, as on a base install.
BLOCKED = """
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "transformers", "kvpress"}:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
        return None

sys.meta_path.insert(0, Block())
from kvdiv.cli import main
main(sys.argv[1:], prog_name="kvdiv")
"""


def _kvdiv(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCKED, *args], capture_output=True, text=True,
                          timeout=240, cwd=cwd)


# Several commands in one blocked interpreter, each reporting its own exit status (one
# start-up for the chain, not one per command: each start imports xarray and the CLI).
CHAIN = BLOCKED.replace("""from kvdiv.cli import main
main(sys.argv[1:], prog_name="kvdiv")""", """import json
from kvdiv.cli import main
for argv in json.loads(sys.argv[1]):
    try:
        main(argv, prog_name="kvdiv")
        rc = 0
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    print(f"\\nkvdiv {argv[0]} exit {rc}", flush=True)
    print(f"\\nkvdiv {argv[0]} exit {rc}", file=sys.stderr, flush=True)
""")


def test_base_commands_work_without_the_model_stack(tmp_path: Path) -> None:
    import json

    from collector import documents as D

    docs = D.write_jsonl([D.Document(f"doc{i}", f"Paragraph {i}.\n\nAnother {i}.") for i in range(4)],
                         tmp_path / "docs.jsonl")
    run, traces = tmp_path / "run", tmp_path / "traces.nc"
    with FakeServer() as server:
        steps = [("collect", "--server", server.url, "--docs", str(docs), "--policies", "snapkv@0.5,recent@0.5",
                  "-R", "3", "-T", "5", "-W", "4", "--seed", "1", "--out", str(run), "--no-progress"),
                 ("pack", str(run), "-o", str(traces)), ("validate", str(traces)), ("info", str(traces)),
                 ("analyze", str(traces), "--out", str(tmp_path / "report"))]
        res = subprocess.run([sys.executable, "-c", CHAIN, json.dumps(steps)], capture_output=True, text=True,
                             timeout=600, cwd=tmp_path)
    assert CHAIN != BLOCKED and res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    for args in steps:   # every command ran, in order, and succeeded
        assert f"kvdiv {args[0]} exit 0" in res.stdout.splitlines(), f"kvdiv {args[0]}: {res.stderr}"
    assert (tmp_path / "report" / "report.html").is_file()


def test_the_blocker_blocks(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-c", BLOCKED.replace("from kvdiv.cli import main\nmain(sys.argv[1:], "
                                                                "prog_name=\"kvdiv\")", "import torch")],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert res.returncode != 0 and "blocked by the test" in res.stderr


def test_serve_without_the_model_stack_says_what_to_install(tmp_path: Path) -> None:
    res = _kvdiv("serve", "--model", "tiny:llama", cwd=tmp_path)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "kvdiv[service]" in res.stderr
