"""Fixtures shared by the collector tests: a fake trace server and a small document set."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from test_collector_support import FakeServer, write_docs


@pytest.fixture()
def fake_server() -> Iterator[FakeServer]:
    with FakeServer() as server:
        yield server


@pytest.fixture()
def docs_file(tmp_path: Path) -> Path:
    return write_docs(tmp_path / "docs.jsonl")
