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
    r = _run(tmp_path, "--dry-run", timeout=1800)   # 4x step limits on shared cores
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    table = (tmp_path / "gpu_check.md").read_text()
    for row in ("(a) GPU-marked tests", "(b) control `full` exactly 0", "(c) coupled vs residual",
                "(d) memory estimate", "shared prompt", "per-row", "eager", "quantized",
                "(e) decoding step vs its floor", "(f) memory estimate ≥ peak, 8 requests batched",
                "(g) control TV exactly 0 in the batch", "128k vocabulary", "152k vocabulary",
                "floor per step = max(bytes / bandwidth, FLOPs / matmul rate)"):
        assert row in table, row
    for section in ("attention", "MLP", "head", "coupling", "host"):   # the per-step breakdown, both models
        assert table.count(f"{section} ") >= 2, section
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


def test_the_step_check_fails_below_the_stated_fraction_of_the_floor():
    mod = _helper()
    assert 0 < mod.MIN_FLOOR_FRACTION < 0.1 < 1 < mod.MAX_FLOOR_FRACTION
    assert not mod.verdict(mod.MIN_FLOOR_FRACTION / 2, dry=False)        # too slow: fails
    assert mod.verdict(mod.MIN_FLOOR_FRACTION, dry=False) and mod.verdict(0.5, dry=False)
    assert not mod.verdict(1.2, dry=False)                              # faster than the floor: the floor is wrong
    assert mod.verdict(mod.MIN_FLOOR_FRACTION / 2, dry=True) and not mod.verdict(0.0, dry=True)


def test_the_serving_plan_is_what_the_check_promises():
    """8 requests, residual, T = 256, a 4k prompt, two controls; and the step count is
    timed at the batch loop's step boundaries inside the survival path."""
    mod = _helper()
    plan = mod.serving_plan(dry=False)
    assert len(plan["prompts"]) == len(mod.SERVING_POLICIES) == 8 and plan["T"] == 256 and max(plan["prompts"]) == 4096
    assert mod.SERVING_POLICIES.count(mod.CONTROL) == 2
    assert mod.LLAMA_8B["vocab_size"] == 128256 and mod.QWEN_7B["vocab_size"] == 152064


def test_a_control_tv_above_zero_fails_the_study_row():
    """Row (b) passes only when the control's occurrence and TV are exactly 0 (before:
    when no larger than snapkv@0.5's)."""
    mod = _helper()
    assert mod.control_exact(0.0, 0.0)
    assert not mod.control_exact(0.0, 4e-6) and not mod.control_exact(1e-3, 0.0)


def test_a_command_run_in_process_reports_its_failure(tmp_path):
    """The dry run's study runs `kvdiv docs/collect/pack` in its own interpreter: a failing
    command must still stop the step with a nonzero status and its message in the log."""
    mod = _helper()
    log = tmp_path / "study.log"
    with pytest.raises(SystemExit, match="kvdiv pack failed"):
        mod._kvdiv("pack", str(tmp_path / "no-such-run"), "-o", str(tmp_path / "x.nc"), log=log, in_process=True)
    text = log.read_text()
    assert text.startswith("$ kvdiv pack") and "no-such-run" in text.split("\n", 1)[1]
    with log.open("a") as fh:
        assert mod._kvdiv_here(("pack", "--help"), fh) == 0
    assert "Usage: kvdiv pack" in log.read_text()
