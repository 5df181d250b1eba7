"""The HTTP process stays light: listing plugins, showing settings and building the app never import torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

# A fresh interpreter each: this test process has long since imported torch.
APP_WITH_ENGINE_PROCESS = """
import sys
from tierserve.settings.config import load_settings
from tierserve.core.plugins import load_plugins
from tierserve.server.app import create_app

plugins = load_plugins()
loaded = load_settings(preset="production", overrides={("server", "engine_process"): True}, plugins=plugins)
create_app(loaded, plugins=plugins)
print("torch" in sys.modules)
"""


def _torch_loaded(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_plugins_and_the_app_load_without_torch():
    assert _torch_loaded(APP_WITH_ENGINE_PROCESS) == "False"


@pytest.mark.parametrize("command", [["plugins", "--json"], ["config", "show", "--preset", "production"]])
def test_cli_listings_load_without_torch(command):
    code = (
        "import sys\nfrom tierserve.cli.main import main\n"
        f"assert main({command!r}) == 0\n"
        "print('torch' in sys.modules)"
    )
    assert _torch_loaded(code) == "False"


def test_a_torch_free_process_gets_a_builtin_checkpoint_from_one_child(tmp_path):
    """The HTTP process asks for a builtin checkpoint without torch: one child writes it, and finishes."""
    code = (
        "import sys\n"
        "from tierserve.models.builtin_models import ensure_builtin_checkpoint\n"
        "path = ensure_builtin_checkpoint('tiny', sys.argv[1])\n"
        "print('RESULT', path, 'torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-2000:]
    [result] = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    _, path, torch_loaded = result.split()
    assert torch_loaded == "False"
    assert (Path(path) / "config.json").is_file() and Path(path).is_relative_to(tmp_path), path
