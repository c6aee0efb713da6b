"""A wheel built from the repository, installed outside the source tree, runs ``kvdiv analyze --plan paper``.

The wheel is built from a copy of the tracked tree (so the checkout gains no
build/ or egg-info), installed with ``--no-deps`` into a fresh virtual environment
whose only other path is the current environment's site-packages (for numpy,
xarray, ...; its editable kvdiv hook is not loaded), and run from a directory
outside the repository with no PYTHONPATH: only the installed package can answer.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _tracked_copy(dest: Path) -> Path:
    """The files git tracks (symlinks kept), or the tree minus build outputs without git."""
    try:
        names = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], check=True, capture_output=True,
                               timeout=60).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(ROOT, dest, symlinks=True,
                        ignore=shutil.ignore_patterns(".git", "build", "dist", "runs", "*.egg-info", "__pycache__"))
        return dest
    for name in filter(None, names):
        src, dst = ROOT / name, dest / name
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the work tree, not yet committed
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, dst)
    return dest


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["MPLBACKEND"] = "Agg"
    return env


def test_wheel_install_runs_analyze_with_the_shipped_plan(tmp_path):
    from divstats.truth.studies import PolicyEffect, simulate_study
    from protocols import save_traces

    src = _tracked_copy(tmp_path / "src")
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheels), str(src)], check=True, timeout=300, cwd=tmp_path, env=_clean_env())
    (wheel,) = wheels.glob("kvdiv-*.whl")

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # Dependencies from this environment's site-packages (a plain path: its .pth hooks,
    # among them the editable kvdiv finder, are not run).
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)],
                   check=True, timeout=300, cwd=tmp_path, env=_clean_env())

    work = tmp_path / "elsewhere"
    work.mkdir()
    where = subprocess.run([str(py), "-c", "import divstats; print(divstats.__file__)"], check=True,
                           capture_output=True, text=True, cwd=work, env=_clean_env()).stdout.strip()
    assert Path(where).is_relative_to(site), where

    policies = {p: PolicyEffect(e, growth=g) for p, e, g in [("snapkv@0.5", 0.04, 0), ("snapkv#512", 0.12, 0),
                                                            ("recent@0.5", 0.12, 0), ("snapkv@0.9", 0.03, 1.0)]}
    save_traces(simulate_study(8, policies, horizon=36, replicates=3, kind="residual", seed=2), work / "traces.nc")
    run = subprocess.run([str(env_dir / "bin" / "kvdiv"), "analyze", "traces.nc", "--plan", "paper", "--out", "out",
                          "-q", "--n-resamples", "99"], capture_output=True, text=True, cwd=work, env=_clean_env(),
                         timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "plan kvdiv-paper sha256=" in run.stdout and "F1-occ-budget" in run.stdout
    assert sorted(p.name for p in (work / "out").iterdir()) == ["report.html", "results.nc", "summary.md"]
    assert "data:image/png;base64," in (work / "out" / "report.html").read_text()
