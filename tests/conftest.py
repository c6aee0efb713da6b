"""Suite-wide settings, the embedded model shared by the tests that need it, the order of modules."""

import os

import pytest

# torch's OpenMP threads busy-wait by default; on a small shared machine that turns a
# millisecond matmul into tens of milliseconds. Must be set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Each xdist worker takes its share of the cores (set before torch loads, so its children
# inherit it too): with torch's default of one thread per core in every worker, two
# workers put four threads on two cores, and a product's threads then wait for each other.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))


# The collector tests' fixtures (one definition; test modules may override them).
pytest_plugins = ["collector_fixtures"]


@pytest.fixture(scope="session")
def embedded_lm():
    """SmolLM2-135M on the CPU, loaded once per process; each test module builds its own
    ``Engine`` (the engine's state is its own; the weights are only read)."""
    pytest.importorskip("gguf")
    from gen_service.models.loading import embedded_gguf_path, load_model

    try:
        embedded_gguf_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return load_model("embedded", device="cpu")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules holding a ``slow`` or ``model`` test first, each module kept whole.

    xdist (``--dist loadfile``) sends a worker a module at a time in collection order
    when ``--no-loadscope-reorder`` is given (the Makefile's), so the long modules start
    first and no long one starts last while the other worker sits idle. (``loadgroup``
    would let tests of several modules share a worker, but xdist 3.8 cannot mark them
    under pytest 9: the nodeid it suffixes is read-only there.)
    """
    heavy = {i.path for i in items if i.get_closest_marker("slow") or i.get_closest_marker("model")}
    items.sort(key=lambda i: i.path not in heavy)   # stable: file order within each class
