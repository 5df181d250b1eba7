"""The documentation: the site in docs/ builds with ``mkdocs build --strict`` (no broken link or anchor), and
every page the README links to is one of its pages."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.integration


def test_the_site_builds_strict(tmp_path):
    pytest.importorskip("material", reason="the docs theme: pip install -e '.[test]' (or '.[docs]')")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "reliability" / "index.html").is_file()
    # the API reference, rendered from the docstrings by mkdocstrings: every hook, and what a plugin implements
    from tierserve.core import hookspecs

    api = (tmp_path / "site" / "api" / "index.html").read_text()
    hooks = [name for name in dir(hookspecs) if hasattr(getattr(hookspecs, name), "tierserve_spec")]
    assert len(hooks) == 9
    for name in (*hooks, "EvictionPolicy", "on_insert", "choose_victim", "CacheTier", "note_removed", "Scheduler",
                 "Speculator", "ModelBackend", "ToolParser", "Figures", "check_cache_tier", "tiny_engine"):  # fmt: skip
        assert f'id="{name}"' in api or f'.{name}"' in api or f"<code>{name}" in api, name
    assert (tmp_path / "site" / "openapi.json").is_file()


def test_the_settings_reference_is_the_settings():
    """``docs/settings.md`` is what ``python -m tierserve.settings.reference`` renders from the settings models
    (every key, its type, default, presets' values and description): a key added or changed without it fails."""
    from tierserve.settings.reference import render

    rendered = render()
    assert (REPO_ROOT / "docs" / "settings.md").read_text() == rendered, (
        "docs/settings.md is stale: python -m tierserve.settings.reference > docs/settings.md"
    )
    assert "| `max_connections` |" in rendered and "### `plugin = \"disk\"`" in rendered


def test_the_http_api_page_and_the_openapi_schema_are_the_apps():
    """``docs/http-api.md`` and ``docs/openapi.json`` are what ``python -m tierserve.server.api_reference`` writes
    from the app: a route, a handler's docstring or a request field changed without them fails."""
    import json

    from tierserve.server.api_reference import build_app, openapi_schema, render

    app = build_app()
    stale = "docs/{} is stale: python -m tierserve.server.api_reference{} > docs/{}"
    assert (REPO_ROOT / "docs" / "http-api.md").read_text() == render(app), stale.format("http-api.md", "", "http-api.md")
    written = json.loads((REPO_ROOT / "docs" / "openapi.json").read_text())
    assert written == openapi_schema(app), stale.format("openapi.json", " --openapi", "openapi.json")
    page = render(app)
    for route in ("POST /v1/cached/completions", "GET /v1/cache/stats", "GET /metrics", "GET /health/ready"):
        assert f"| `{route}` |" in page


def test_the_readme_links_to_pages_that_exist_and_stays_short():
    readme = (REPO_ROOT / "README.md").read_text()
    pages = set(re.findall(r"\]\(docs/([\w-]+\.md)", readme))
    assert {"getting-started.md", "kv-cache.md", "reliability.md", "plugins.md", "benchmarks.md"} <= pages
    assert all((REPO_ROOT / "docs" / page).is_file() for page in pages), pages
    assert len(readme.splitlines()) <= 300
