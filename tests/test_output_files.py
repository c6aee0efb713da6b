"""Output files follow the process umask, and a non-editable build leaves the checkout clean.

Issue: report files were written 0600 (``tempfile.mkstemp`` creates its file 0600 and the
writers reopened it, keeping the mode), and ``pip install .`` left ``build/`` and
``kvdiv.egg-info/`` in the checkout.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from collector.documents import Document, write_jsonl
from divstats.report.analysis import compute
from divstats.report.write import OUTPUT_FILES, write_report
from divstats.truth.studies import PolicyEffect, simulate_study
from protocols.examples import example_dataset
from protocols.io import save_traces

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def umask():
    """Set a umask for one test and restore the previous one."""
    before = os.umask(0o022)
    os.umask(before)
    yield os.umask
    os.umask(before)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(scope="module")
def analysis():
    ds = simulate_study(4, {"a": PolicyEffect(0.1)}, horizon=6, replicates=3, seed=1)
    return compute(ds, n_resamples=99, progress=False)


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_report_files_take_the_umask(analysis, tmp_path, umask, mask):
    umask(mask)
    paths = write_report(analysis, tmp_path / "out")
    assert sorted(paths) == sorted(OUTPUT_FILES)
    for path in paths.values():
        assert _mode(path) == 0o666 & ~mask, (path.name, oct(_mode(path)))


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_traces_and_documents_take_the_umask(tmp_path, umask, mask):
    umask(mask)
    traces = save_traces(example_dataset(), tmp_path / "t.nc")
    docs = write_jsonl([Document("a", "x")], tmp_path / "d.jsonl")
    assert (_mode(traces), _mode(docs)) == (0o666 & ~mask, 0o666 & ~mask)


def _tracked_copy(dest: Path) -> Path:
    names = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           check=True, capture_output=True, timeout=60).stdout.decode().split("\0")
    for name in filter(None, names):
        src, dst = ROOT / name, dest / name
        if not src.exists() and not src.is_symlink():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(os.readlink(src))
        else:
            dst.write_bytes(src.read_bytes())
    return dest


@pytest.mark.slow
def test_building_a_wheel_leaves_no_build_outputs_in_the_tree(tmp_path):
    if not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to list the tracked files")
    src = _tracked_copy(tmp_path / "src")
    def tree() -> list[Path]:   # __pycache__ (the backend's own bytecode) is git-ignored, like any other
        return sorted(p.relative_to(src) for p in src.rglob("*") if "__pycache__" not in p.parts)

    before = tree()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "wheels"), str(src)], check=True, timeout=300, cwd=tmp_path, env=env)
    (wheel,) = (tmp_path / "wheels").glob("kvdiv-*.whl")
    # pip's isolated build (the default, which needs the registry) first asks the backend for its build
    # requirements and the metadata: setuptools runs egg_info for both, so call them too
    hooks = ("import sys; sys.path.insert(0, '_backend'); import kvdiv_build as b; b.get_requires_for_build_wheel(); "
             f"b.prepare_metadata_for_build_wheel({str(tmp_path / 'meta')!r})")
    (tmp_path / "meta").mkdir()
    subprocess.run([sys.executable, "-c", hooks], check=True, timeout=300, cwd=src, env=env, capture_output=True)
    assert list((tmp_path / "meta").glob("kvdiv-*.dist-info"))
    after = tree()
    assert after == before, sorted(set(after) - set(before))[:10]
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("divstats/templates/") for n in names)
    assert not any(n.startswith("_backend") for n in names)
