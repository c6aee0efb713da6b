"""The distribution's version, read once from its installed metadata.

A module of its own so that the contract's builders (``schema``) can stamp the
producer without importing the package root, which imports them.
"""

from importlib.metadata import PackageNotFoundError, version

__all__ = ["__version__"]

try:  # one version source: the installed distribution's metadata
    __version__ = version("kvdiv")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
