"""A throw-away ``redis-server`` for the benchmarks that need one (no persistence, a free loopback port)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time


def start_redis_server() -> tuple[subprocess.Popen, str]:
    """Start one; returns the process (stop it by terminating it) and its URL."""
    import redis

    if shutil.which("redis-server") is None:
        raise RuntimeError("this benchmark needs redis-server (apt-get install redis-server)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tempfile.mkdtemp())
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(200):
        try:
            redis.Redis.from_url(url).ping()
            return process, url
        except redis.ConnectionError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError("redis-server did not start")
