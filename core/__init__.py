"""tierserve's small core: hookspecs, plugin manager and registries, settings, CLI."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from tierserve.core.hookspecs import hookimpl

try:
    __version__ = version("tierserve")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__", "hookimpl"]
