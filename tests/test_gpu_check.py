"""benchmarks/gpu_check.sh cannot rot and cannot pass by accident: its dry run runs every
step on the CPU with tiny models; without --dry-run and without CUDA it fails, naming
CUDA; a skipped GPU test fails the table's first row."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def _run(tmp_path: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path), "KVDIV_SITE": str(tmp_path / "site"),
           "KVDIV_GPU_WORK": str(tmp_path / "work"),
           "PYTHONPATH": str(ROOT)}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _helper():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_the_check_fails_naming_cuda(tmp_path):
    r = _run(tmp_path, timeout=120)
    assert r.returncode != 0
    assert "CUDA" in r.stderr, r.stderr
    assert not (tmp_path / "gpu_check.md").exists()


@pytest.mark.slow
def test_dry_run_runs_every_step(tmp_path):
    r = _run(tmp_path, "--dry-run", timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    table = (tmp_path / "gpu_check.md").read_text()
    for row in ("(a) GPU-marked tests", "(b) noise floor", "(c) coupled vs residual", "(d) memory estimate",
                "shared prompt", "per-row", "eager", "quantized", "(e) row-steps/s", "floor bytes/step"):
        assert row in table, row
    assert "FAIL" not in table and "did not finish" not in table
    assert "interpreter: " + sys.executable in out
    assert (tmp_path / "logs" / "study.log").exists()


def test_a_skipped_gpu_test_fails_the_check(tmp_path):
    mod = _helper()
    xml = tmp_path / "junit.xml"
    xml.write_text('<testsuites><testsuite><testcase name="a"/><testcase name="b">'
                   '<skipped message="needs a CUDA device"/></testcase></testsuite></testsuites>')
    row = mod.tests_row(xml, dry=False)
    assert not row["ok"] and "1 skipped" in row["result"] and "CUDA" in row["result"]
    assert mod.tests_row(xml, dry=True)["ok"]
    assert not mod.tests_row(tmp_path / "missing.xml", dry=False)["ok"]
    xml.write_text('<testsuites><testsuite><testcase name="a"/></testsuite></testsuites>')
    assert mod.tests_row(xml, dry=False)["ok"]
    xml.write_text('<testsuites><testsuite></testsuite></testsuites>')   # nothing collected
    assert not mod.tests_row(xml, dry=False)["ok"]


def test_the_bandwidth_floor_counts_what_a_step_reads():
    mod = _helper()
    assert mod.kept("snapkv@0.5", 2048) == 1024 and mod.kept("snapkv#512", 2048) == 512
    assert mod.kept("snapkv#512", 100) == 100 and mod.kept("full", 2048) == 2048
    assert mod.kept("snapkv@0.9", 2000) == 1800
