"""mkdocs hook: lays the source folders out as the ``tierserve`` package for mkdocstrings to read.

The repository's top-level folders install as ``tierserve.<folder>`` (``pyproject.toml``'s package-dir), so
there is no ``tierserve/`` folder for griffe to find. Before the build this writes ``build/api-src/tierserve/``
with one symbolic link per installed package; ``mkdocs.yml`` points the Python handler there.
"""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "api-src"


def on_startup(command: str, dirty: bool) -> None:
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    shutil.rmtree(TREE, ignore_errors=True)
    (TREE / "tierserve").mkdir(parents=True)
    for package, folder in package_dirs.items():
        (TREE / Path(*package.split("."))).symlink_to(ROOT / folder, target_is_directory=True)
