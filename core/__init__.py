"""tierserve's small core: hookspecs, the plugin manager and registries, and the contracts (backend, scheduler,
speculator, tool parser, sequences and batches, sampling parameters, the settings schema)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from tierserve.core.hookspecs import hookimpl

try:
    __version__ = version("tierserve")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__", "hookimpl"]
