"""Shared test helpers: temporary installed plugin distributions, and the root logger put back after a test."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import logging

import pytest
import structlog
from hypothesis import settings

# CI runs the property tests with a fixed seed so a green run stays green;
# local runs explore fresh examples each time (and found real bugs that way).
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

REPO_ROOT = Path(__file__).resolve().parent.parent

# pytest-xdist runs one worker per core: each computes on one thread (engine child processes and
# servers inherit it), so the workers share the cores instead of fighting over them
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


@pytest.fixture
def restore_logging():
    """Undo a test's ``configure_logging``: the root logger's handlers and level, structlog's defaults."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers, root.level = handlers, level
    structlog.reset_defaults()


@pytest.fixture
def toml_file(tmp_path):
    """``toml_file(text, name="config.toml")`` writes dedented TOML into the test's folder and returns its path."""

    def write(text: str, name: str = "config.toml"):
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path

    return write


@pytest.fixture
def install_fake_plugin(tmp_path, monkeypatch):
    """Write a real installed distribution (dist-info + module) onto sys.path.

    ``install_fake_plugin(dist, module, source, entry_point=None)`` returns the
    site folder; importlib.metadata finds its ``tierserve`` entry point exactly
    as it finds one that pip installed.
    """
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    installed: list[str] = []

    def install(dist: str, module: str, source: str, entry_point: str | None = None) -> Path:
        (site / f"{module}.py").write_text(textwrap.dedent(source))
        info = site / f"{dist.replace('-', '_')}-1.2.3.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
        (info / "entry_points.txt").write_text(f"[tierserve]\n{entry_point or module} = {module}\n")
        installed.append(module)
        return site

    yield install
    for module in installed:
        sys.modules.pop(module, None)
