"""The PEP 517 build backend: setuptools, building outside the source tree.

setuptools builds a wheel in ``build/`` and writes ``kvdiv.egg-info/`` beside the
sources, so a plain ``pip install .`` left both in the checkout. Here every hook that
builds a wheel or its metadata runs with ``DIST_EXTRA_CONFIG`` (read by setuptools'
distutils after setup.cfg) pointing at a config that moves ``build_base`` and
``egg_base`` into a temporary directory removed afterwards. The wheel itself is the
one ``setuptools.build_meta`` builds; editable installs and sdists are passed through
unchanged (an editable install keeps its metadata in the checkout by design).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import (  # noqa: F401  (the hooks passed through unchanged)
    build_editable,
    build_sdist,
    get_requires_for_build_editable,
    get_requires_for_build_sdist,
    prepare_metadata_for_build_editable,
)


@contextlib.contextmanager
def _out_of_tree() -> Iterator[None]:
    with tempfile.TemporaryDirectory(prefix="kvdiv-build-") as tmp:
        cfg = Path(tmp) / "out_of_tree.cfg"
        cfg.write_text(f"[build]\nbuild_base = {Path(tmp) / 'build'}\n\n[egg_info]\negg_base = {tmp}\n",
                       encoding="utf-8")
        before = os.environ.get("DIST_EXTRA_CONFIG")
        os.environ["DIST_EXTRA_CONFIG"] = str(cfg)
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("DIST_EXTRA_CONFIG", None)
            else:
                os.environ["DIST_EXTRA_CONFIG"] = before


def get_requires_for_build_wheel(config_settings=None):
    # setuptools runs egg_info here too (pip calls it first, in an isolated build)
    with _out_of_tree():
        return _setuptools.get_requires_for_build_wheel(config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    with _out_of_tree():
        return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    with _out_of_tree():
        return _setuptools.prepare_metadata_for_build_wheel(metadata_directory, config_settings)
