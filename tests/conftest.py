"""Suite-wide settings, the embedded model shared by the tests that need it, and xdist work units."""

import os

import pytest

# torch's OpenMP threads busy-wait by default; on a small shared machine that turns a
# millisecond matmul into tens of milliseconds. Must be set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# The collector tests' fixtures (one definition; test modules may override them).
pytest_plugins = ["collector_fixtures"]

#: The xdist work unit of the tests that use the embedded model (``embedded_lm``): one
#: worker loads it once for all of them (about 5 s of CPU a load, four modules).
EMBEDDED_GROUP = "embedded_model"


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
    """Work units for ``--dist loadgroup`` (the Makefile's), heaviest first.

    A test runs in its module's unit, so module fixtures (a loaded model, a live
    server) are built once, unless it names its own with ``xdist_group``: the tests
    on the embedded model share one unit, and a long test alone in a module of short
    ones gets its own so the other worker is not kept waiting behind it. Units holding
    a ``slow`` or ``model`` test go first (longest first keeps the last unit short;
    the Makefile passes ``--no-loadscope-reorder``, which keeps this order). Runs
    before xdist reads the marks (tryfirst).
    """
    def unit(item: pytest.Item) -> str:
        mark = item.get_closest_marker("xdist_group")
        return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))

    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
    heavy = {unit(i) for i in items if i.get_closest_marker("slow") or i.get_closest_marker("model")}
    items.sort(key=lambda i: unit(i) not in heavy)   # stable: file order within each class
