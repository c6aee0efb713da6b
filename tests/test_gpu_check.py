"""benchmarks/gpu_check.sh cannot rot and cannot pass by accident: its dry run runs every
step on the CPU with tiny models; without --dry-run and without CUDA it fails, naming
CUDA; a skipped GPU test fails the table's first row."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
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


@pytest.fixture
def fork_server(tmp_path):
    """benchmarks/fork_server.py serving (nothing preloaded), and a function that runs
    ``python ARGS`` through it as the dry run's steps do."""
    sock = tmp_path / "fork.sock"
    script = str(ROOT / "benchmarks" / "fork_server.py")
    server = subprocess.Popen([sys.executable, script, "serve", str(sock), "json"], stdin=subprocess.DEVNULL)
    for _ in range(200):
        if sock.exists():
            break
        time.sleep(0.02)

    def run(*args, **kw):
        return subprocess.Popen([sys.executable, script, "run", str(sock), *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, **kw)

    yield run
    server.kill()
    server.wait()


def _child_pid_alive(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text()), 0)
    except ProcessLookupError:
        return False
    return True


def test_a_forked_command_runs_as_its_own_interpreter_would(fork_server, tmp_path):
    """Arguments, working directory, environment and standard streams are the caller's; the
    status is the command's (an int as is, a message 1, a crash 1 with its traceback)."""
    script = tmp_path / "s.py"
    script.write_text("import os, sys\nprint(sys.argv[1:], os.getcwd(), os.environ['K'])\n"
                      "print('to stderr', file=sys.stderr)\nsys.exit(int(sys.argv[1]))\n")
    p = fork_server(str(script), "7", "x", cwd=tmp_path, env={**os.environ, "K": "v"})
    out, err = p.communicate(timeout=30)
    assert p.returncode == 7 and out == f"['7', 'x'] {tmp_path} v\n" and err == "to stderr\n"
    p = fork_server("-", stdin=subprocess.PIPE)
    out, _ = p.communicate("import sys\nprint(sys.stdin.read() or 'read')\nraise SystemExit('a message')\n",
                           timeout=30)
    assert (p.returncode, out) == (1, "read\n")
    p = fork_server("-c", "import json\nraise ValueError('boom')")
    _, err = p.communicate(timeout=30)
    assert p.returncode == 1 and "ValueError: boom" in err
    p = fork_server("-m", "json.tool", stdin=subprocess.PIPE)
    assert p.communicate('{"a": 1}', timeout=30)[0].split() == ["{", '"a":', "1", "}"] and p.returncode == 0


def test_a_signal_to_the_caller_reaches_the_command_and_a_dead_caller_takes_it(fork_server, tmp_path):
    """``timeout`` and ``Popen.terminate`` signal the caller: the command gets the signal and the
    caller exits with its status (143); a caller killed outright leaves no command behind."""
    pid_file = tmp_path / "pid"
    code = f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)\n"
    for stop, status in ((subprocess.Popen.terminate, 143), (subprocess.Popen.kill, -9)):
        pid_file.unlink(missing_ok=True)
        p = fork_server("-c", code)
        for _ in range(500):
            if pid_file.exists() and pid_file.read_text():
                break
            time.sleep(0.02)
        assert _child_pid_alive(pid_file)
        stop(p)
        p.communicate(timeout=30)
        assert p.returncode == status
        for _ in range(250):
            if not _child_pid_alive(pid_file):
                break
            time.sleep(0.02)
        assert not _child_pid_alive(pid_file)
