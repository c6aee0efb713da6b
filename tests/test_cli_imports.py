"""The CLI dispatcher keeps the package boundaries: lazy imports, no torch for stats."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import protocols

PROBE = """
import sys
from kvdiv.cli import main
try:
    main({args!r}, standalone_mode=False)
except SystemExit:
    pass
heavy = sorted(m for m in ("torch", "transformers", "httpx", "kvpress", "gen_service", "divstats")
               if m in sys.modules)
print("HEAVY=" + ",".join(heavy))
"""


def _loaded(args: list[str]) -> set[str]:
    out = subprocess.run([sys.executable, "-c", PROBE.format(args=args)],
                         capture_output=True, text=True, timeout=120)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("HEAVY=")]
    assert line, out.stdout + out.stderr
    return set(filter(None, line[-1][len("HEAVY="):].split(",")))


def test_help_imports_no_package() -> None:
    assert _loaded(["--help"]) == set()


def test_every_subcommand_resolves() -> None:
    from kvdiv.cli import SUBCOMMANDS, main

    for name in SUBCOMMANDS:
        cmd = main.get_command(None, name)  # type: ignore[arg-type]
        assert cmd is not None and cmd.help, f"kvdiv {name} has no help text"


@pytest.fixture()
def traces(tmp_path):
    rng = np.random.default_rng(0)
    tv = rng.uniform(0.01, 0.5, size=(2, 1, 3, 4))
    x = rng.integers(0, 5, size=tv.shape)
    ds = protocols.coupled_dataset(tv, x, (x + 1) % 5, vocab_size=5, policies=["snapkv@0.5"])
    path = tmp_path / "t.nc"
    protocols.save_traces(ds, path)
    return path


def test_validate_and_info_do_not_import_torch_or_stats(traces) -> None:
    assert _loaded(["validate", str(traces)]) == set()
    assert _loaded(["info", str(traces)]) == set()


def test_analyze_does_not_import_torch(traces, tmp_path) -> None:
    loaded = _loaded(["analyze", "--help"])
    assert "torch" not in loaded and "gen_service" not in loaded and "httpx" not in loaded


def test_policy_registry_imports_without_torch() -> None:
    """Importing the registry (benchmarks' and tools' processes do) loads neither torch nor transformers:
    a ``quant:kivi`` term's settings are torch-free; the caches (``quantized.kivi_cache``) hold torch."""
    probe = ("import sys, gen_service.presses.registry as r; "
             "print('HEAVY=' + ','.join(m for m in ('torch', 'transformers', 'kvpress') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert "HEAVY=\n" in out.stdout, out.stdout + out.stderr
    from gen_service.presses import kivi, quantized, registry

    assert registry.KIVIConfig is quantized.KIVIConfig is kivi.KIVIConfig   # one class, re-exported
    assert type(quantized.kivi_cache(kivi.KIVIConfig(4), 2)).__name__ == "FakeQuantizedCache"


def test_protocols_and_divstats_import_without_click() -> None:
    """The packages load click only when a command is built (``protocols.chunks.cluster_options``)."""
    probe = "import sys, protocols, divstats; print('CLICK=' + str('click' in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert "CLICK=False" in out.stdout, out.stdout + out.stderr
