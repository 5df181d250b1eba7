"""No secret in any log: API keys never appear in log output, a settings dump, or an error.

Regression test for the hardening issue: any 500 logged a traceback with
local variables, among them ``settings.auth`` (every API and admin key) and
the request's Authorization header, in both console and JSON logs.
"""

from __future__ import annotations

import io
import subprocess
import sys

import httpx
import pytest
from litestar import Request, get

from tests.engine_helpers import build_checkpoint, make_engine
from tests.server_helpers import running_server
from tierserve.core import hookimpl
from tierserve.settings.config import load_settings
from tierserve.settings.logs import configure_logging
from tierserve.settings.secrets import auth_secrets

pytestmark = pytest.mark.integration

USER_KEY = "sk-user-5f0c1b7e9a"
ADMIN_KEY = "sk-admin-77d2c4e8b1"
TEAM_KEY = "sk-team-a91e3f0d62"
AUTH = {("auth", "api_keys"): [USER_KEY], ("auth", "admin_api_keys"): [ADMIN_KEY],
        ("auth", "tenants"): {"team": [TEAM_KEY]}}  # fmt: skip


class FailingRoute:
    """A plugin route that fails with the request's header and the settings in its local variables."""

    @hookimpl
    def register_routes(self, register):
        @get("/v1/fail")
        async def fail(request: Request) -> dict:
            authorization = request.headers.get("authorization")
            settings = request.app.state.tierserve.settings
            raise RuntimeError(f"the handler failed ({len(authorization or '')}, {settings.server.port})")

        register("fail", fail)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", "llama")


@pytest.mark.parametrize("log_format", ["json", "console"])
def test_no_key_reaches_the_logs_of_failures_and_bad_requests(checkpoint, log_format, restore_logging):
    overrides = {("model", "path"): str(checkpoint), ("logging", "format"): log_format, **AUTH}
    loaded = load_settings(None, environ={}, overrides=overrides)
    loaded.plugins.add_plugin(FailingRoute(), "failing-route", "0", "test")
    stream = io.StringIO()
    configure_logging(loaded.settings.logging, stream=stream, secrets=auth_secrets(loaded.settings.auth))
    engine = make_engine(checkpoint)
    with running_server(loaded.settings, engine=engine, plugins=loaded.plugins) as base:
        for key in (USER_KEY, ADMIN_KEY, TEAM_KEY):
            failed = httpx.get(f"{base}/v1/fail", headers={"Authorization": f"Bearer {key}"}, timeout=30)
            assert failed.status_code == 500 and key not in failed.text
        hostile = [
            ("POST", "/v1/completions", {"prompt": USER_KEY, "max_tokens": 0}),  # a key in the input, echoed in errors?
            ("POST", "/v1/cached/completions", {"prompt": "x", "cache_key": ADMIN_KEY, "beam_width": 2}),
            ("POST", "/v1/cache/warm", {"prompts": ["x"], ADMIN_KEY: 1}),
            ("POST", "/v1/cache/clear", {"tiers": [TEAM_KEY]}),
            ("GET", f"/v1/models/{USER_KEY}", None),
        ]
        for method, path, body in hostile:
            reply = httpx.request(method, base + path, json=body, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
            assert 400 <= reply.status_code < 500 or reply.status_code == 501, (path, reply.text)  # 501: not built
        wrong = httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {USER_KEY}x"})
        assert wrong.status_code == 401
    engine.close()
    output = stream.getvalue()
    assert "request_failed" in output and "RuntimeError" in output  # the failure was logged, with its traceback
    for key in (USER_KEY, ADMIN_KEY, TEAM_KEY):
        assert key not in output, f"{key} in the {log_format} logs"
    assert "authorization = " not in output.lower()  # no local variables in tracebacks


def test_config_show_never_prints_a_key(tmp_path):
    config = tmp_path / "tierserve.toml"
    config.write_text(f'[auth]\napi_keys = ["{USER_KEY}"]\nadmin_api_keys = ["{ADMIN_KEY}"]\n'
                      f'[auth.tenants]\nteam = ["{TEAM_KEY}"]\n')  # fmt: skip
    for extra in ([], ["--json"]):
        shown = subprocess.run([sys.executable, "-m", "tierserve.cli.main", "config", "show", "--config", str(config),
                                *extra], capture_output=True, text=True, timeout=60)  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        assert "[redacted] key-" in shown.stdout
        for key in (USER_KEY, ADMIN_KEY, TEAM_KEY):
            assert key not in shown.stdout + shown.stderr
