"""pytest fixtures for plugin authors: ``pytest_plugins = ["tierserve.testing.fixtures"]`` in a conftest.py.

* ``tierserve_plugins(*plugins)``: the built-ins plus ``plugins`` (modules, ``component_plugin`` objects, or
  paths and module names as ``tierserve serve --plugin`` takes them), as ``tierserve.testing.plugin_manager``.
* ``tierserve_engine(settings=None, plugins=None)``: an in-process engine on ``builtin:tiny``, closed after the test.
* ``tierserve_client(settings=None, plugins=None)``: an HTTP test client on the server app, closed after the test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pytest

from tierserve.core.plugins import PluginManager
from tierserve.testing.harness import http_client, plugin_manager, tiny_engine


@pytest.fixture
def tierserve_plugins() -> Callable[..., PluginManager]:
    """``tierserve_plugins(*plugins, installed=False)``: a plugin manager with the built-ins and ``plugins``."""
    return plugin_manager


@pytest.fixture
def tierserve_engine() -> Iterator[Callable[..., Any]]:
    """``tierserve_engine(settings=None, plugins=None)``: an engine on ``builtin:tiny`` (``tierserve.testing.tiny_engine``)."""
    with ExitStack() as stack:
        yield lambda settings=None, plugins=None: stack.enter_context(tiny_engine(settings, plugins))


@pytest.fixture
def tierserve_client() -> Iterator[Callable[..., Any]]:
    """``tierserve_client(settings=None, plugins=None)``: a test client on the server (``tierserve.testing.http_client``)."""
    with ExitStack() as stack:
        yield lambda settings=None, plugins=None: stack.enter_context(http_client(settings, plugins))
