"""``tierserve fleet`` stopped by SIGTERM leaves no process behind: the Ray cluster it started, its helpers,
the replicas and their engines all end (tierserve.fleet.processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.server_helpers import free_port
from tests.waiting import wait_until
from tierserve.fleet.processes import alive, process_tree

pytestmark = pytest.mark.fleet
pytest.importorskip("ray", reason="pip install -e '.[test]' installs ray[serve]")


def test_a_fleet_stopped_by_sigterm_leaves_no_process_behind(tmp_path):
    port = free_port()
    tierserve = str(Path(sys.executable).with_name("tierserve"))
    command = [tierserve, "fleet", "--preset", "development", "--port", str(port), "--replicas", "1",
               "--set", 'model.path="builtin:tiny"', "--set", 'logging.level="warning"']  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with open(tmp_path / "fleet.log", "wb") as log:
        fleet = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        def ready() -> bool:
            assert fleet.poll() is None, (tmp_path / "fleet.log").read_text()[-3000:]
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout=180, interval=1, what="the fleet ready")
        started = process_tree(fleet.pid)[1:]
        assert len(started) >= 3  # Ray's own processes, the replica's and its engine's at least
        fleet.send_signal(signal.SIGTERM)
        assert fleet.wait(timeout=90) == 0
        wait_until(lambda: not [pid for pid in started if alive(pid)], timeout=30, interval=0.5,
                   what="every process the fleet started ended")  # fmt: skip
    finally:
        if fleet.poll() is None:
            fleet.kill()
            fleet.wait(timeout=30)
