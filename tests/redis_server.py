"""A real ``redis-server`` for tests: on a free loopback port, in a temporary folder, stopped by its PID.

The OS package provides the binary (``.ci/run`` installs it when missing); without it a
test that starts a server skips locally and fails under ``CI``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis

from tests.conftest import require_service
from tests.server_helpers import free_port


def redis_server_binary() -> str:
    """The path of ``redis-server``; skips the test (fails it under CI) when the OS package is missing."""
    found = shutil.which("redis-server")
    if not found:
        require_service("redis-server", "apt-get install redis-server or brew install redis (.ci/run does)")
    return found


class RedisServer:
    """One ``redis-server`` process; ``start`` again after ``kill`` reuses the port (an empty server)."""

    def __init__(self, directory: Path, *extra: str) -> None:
        self.directory = directory
        self.port = free_port()
        self.extra = extra
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=2)

    def start(self) -> RedisServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        command = [
            redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(self.directory), *self.extra,
        ]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                if self.client().ping():
                    return self
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
        self.process = None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.process = None
