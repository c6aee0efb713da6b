"""Suite-wide settings."""

import os

# torch's OpenMP threads busy-wait by default; on a small shared machine that turns a
# millisecond matmul into tens of milliseconds. Must be set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# The collector tests' fixtures (one definition; test modules may override them).
pytest_plugins = ["collector_fixtures"]
