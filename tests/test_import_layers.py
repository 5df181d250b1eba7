"""No import cycles between the top-level folders (tierserve.cache, .core, .models, .settings, .engine, .plugins,
.server, .fleet, .cli, .plugin_api, .testing).

Read over the AST of every module, function-local imports included. Imports under ``if TYPE_CHECKING:``
only name types for annotations and never run, so they do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("core", "cache", "models", "settings", "engine", "plugins", "server", "fleet", "cli", "configs", "plugin_api",
           "testing")


def _type_checking_blocks(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(inner) for stmt in node.body for inner in ast.walk(stmt)}
    return skipped


def folder_imports() -> dict[str, dict[str, list[str]]]:
    """``{folder: {imported folder: ["file: module", ...]}}`` for every runtime import across folders."""
    edges: dict[str, dict[str, list[str]]] = {folder: {} for folder in FOLDERS}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            skipped = _type_checking_blocks(tree)
            for node in ast.walk(tree):
                if id(node) in skipped:
                    continue
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    modules = [node.module]
                elif isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                else:
                    continue
                for module in modules:
                    parts = module.split(".")
                    if parts[0] == "tierserve" and len(parts) > 1 and parts[1] != folder and parts[1] in FOLDERS:
                        where = f"{path.relative_to(ROOT)}: {module}"
                        edges[folder].setdefault(parts[1], []).append(where)
    return edges


def find_cycle(edges: dict[str, dict[str, list[str]]]) -> list[str] | None:
    """One cycle of folders (``[a, b, ..., a]``), or None."""
    state: dict[str, str] = {}

    def visit(folder: str, path: list[str]) -> list[str] | None:
        state[folder] = "open"
        for target in edges.get(folder, {}):
            if state.get(target) == "open":
                return path[path.index(target) :] + [target]
            if target not in state:
                found = visit(target, [*path, target])
                if found:
                    return found
        state[folder] = "done"
        return None

    for folder in edges:
        if folder not in state:
            found = visit(folder, [folder])
            if found:
                return found
    return None


def test_top_level_folders_import_one_way():
    edges = folder_imports()
    cycle = find_cycle(edges)
    if cycle:
        witnesses = [f"{a} -> {b}: {edges[a][b][:3]}" for a, b in zip(cycle, cycle[1:])]
        pytest.fail("import cycle between top-level folders: " + " -> ".join(cycle) + "\n" + "\n".join(witnesses))


def test_core_holds_contracts_only():
    """core (hookspecs, plugin manager, contracts) imports nothing above it: no engine, settings loading,
    model loading, plugin, server, fleet or CLI."""
    edges = folder_imports()
    assert set(edges["core"]) <= {"cache"}, edges["core"]


def test_the_layers_the_readme_describes():
    """Each folder imports only folders below it in the README's order (skipping ahead is allowed)."""
    order = ["cache", "core", "models", "settings", "engine", "plugins", "server", "fleet", "cli", "plugin_api", "testing"]
    edges = folder_imports()
    upward = {
        f"{folder} -> {target}": where[:3]
        for folder, targets in edges.items()
        if folder in order
        for target, where in targets.items()
        if target in order and order.index(target) > order.index(folder)
    }
    assert not upward, upward


def test_the_check_sees_a_cycle():
    assert find_cycle({"a": {"b": ["x"]}, "b": {"a": ["y"]}}) == ["a", "b", "a"]
    assert find_cycle({"a": {"b": ["x"]}, "b": {}}) is None
