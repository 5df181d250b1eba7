"""A graceful stop keeps the cache: SIGTERM or SIGINT, to the server process or to its whole process group (what
systemd's ``KillMode=control-group`` and ``kill -TERM -PGID`` do), lets the engine core process drain every
tier's queued writes before it exits, so a restarted server finds every cacheable prompt token on disk."""

from __future__ import annotations

import os
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.server_helpers import free_port, wait_ready

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BLOCK = 16
PROMPTS = [" ".join(f"word{i}-{j}" for j in range(60)) for i in range(24)]


def _serve(port: int, cache: Path, disk: Path) -> subprocess.Popen:
    import sys

    config = disk.parent / "tiers.toml"
    # a write queue long enough that nothing is dropped: every block the prompts make is queued, most of them
    # still unwritten when the signal comes, so only a drain keeps them
    config.write_text(f"""
[[kv_cache.tiers]]
name = "l3"
plugin = "disk"
path = "{disk}"
persistent = true
write_through = true
write_queue = 4096
""")
    command = [
        str(Path(sys.executable).parent / "tierserve"), "serve", "--preset", "development", "--port", str(port),
        "--config", str(config), "--set", f"kv_cache.block_size={BLOCK}", "--set", "logging.level=\"warning\"",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERSERVE_")} | {"TIERSERVE_CACHE_DIR": str(cache)}
    # a session of its own: its process group is the server and its core, as a service manager starts them
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip


def _cached(base: str) -> tuple[int, int]:
    """(cached prompt tokens, cacheable prompt tokens: whole blocks before the last token) over PROMPTS."""

    def one(prompt: str) -> tuple[int, int]:
        reply = httpx.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0},
                           timeout=120)  # fmt: skip
        assert reply.status_code == 200, reply.text
        usage = reply.json()["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return cached, (usage["prompt_tokens"] - 1) // BLOCK * BLOCK

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, PROMPTS))
    return sum(c for c, _ in results), sum(t for _, t in results)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("to_group", [True, False], ids=["process-group", "server-process"])
def test_a_signal_then_a_restart_loses_no_cached_token(tmp_path, signum, to_group):
    cache, disk = tmp_path / "cache", tmp_path / "l3"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = _serve(port, cache, disk)
    try:
        wait_ready(base, 180)
        cached, cacheable = _cached(base)
        assert cacheable > 0 and cached < cacheable  # mostly computed: the writes to drain are many
        # at once: the disk tier's writer still has most of the prompts' blocks queued
        os.killpg(server.pid, signum) if to_group else server.send_signal(signum)
        output, _ = server.communicate(timeout=120)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    again = _serve(port, cache, disk)
    try:
        wait_ready(base, 180)
        found, cacheable_again = _cached(base)
    finally:
        os.killpg(again.pid, signal.SIGINT)
        again.communicate(timeout=120)
    assert cacheable_again == cacheable
    assert found == cacheable, f"{found} of {cacheable} cacheable prompt tokens found after the restart"
    assert server.returncode == 0, output  # a stop asked for is a clean exit, whichever signal asked
    assert "Traceback" not in output
