"""The dequantised-model and tokenizer caches are written whole or not at all, so
several processes (the suite's workers, two servers) may fill them at once."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from gen_service.models.loading import _publish

FILES = ("config.json", "model.safetensors", "tokenizer_config.json")


def _slow_writer(tag: str):
    def write(tmp: Path) -> None:
        for name in FILES:
            (tmp / name).write_text(tag)
            time.sleep(0.01)   # a reader looking now would see half a directory
    return write


def test_racing_writers_publish_one_whole_directory_and_leave_no_temporaries(tmp_path: Path) -> None:
    target = tmp_path / "models" / "m"
    seen: list[set[str]] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            if target.exists():
                seen.append({p.name for p in target.iterdir()})

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=_publish, args=(target, _slow_writer(str(i)))) for i in range(4)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stop.set()
    reader.join()
    assert {p.name for p in target.iterdir()} == set(FILES)
    assert len({(target / n).read_text() for n in FILES}) == 1      # one writer's copy, not a mix
    assert all(s == set(FILES) for s in seen)                       # never half a directory
    assert [p.name for p in target.parent.iterdir()] == ["m"]       # the losers' copies are gone


def test_a_failed_write_leaves_nothing_and_raises(tmp_path: Path) -> None:
    target = tmp_path / "m"

    def fail(tmp: Path) -> None:
        (tmp / "config.json").write_text("{}")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        _publish(target, fail)
    assert list(tmp_path.iterdir()) == []
