"""A Ray cluster of two nodes on this machine, for the fleet's node-loss test and bench part.

``ray start --head`` and a second ``ray start --address``, each blocking in a
process of its own (so each node is one process tree: ``ray start``, its raylet
and agents, the raylet's workers, their children). Both take an auth token of
their own temp folder, and detect a lost node in about 3 s
(``health_check_period_ms`` 1,000 x 3 misses; Ray's default is 5 x 3 s). A node
is killed as a lost machine would be: SIGKILL to every process of its tree, by
PID. ``stop`` ends both trees the same way once ``ray start`` had its chance
to stop them itself.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.server_helpers import free_port
from tierserve.fleet.processes import end_processes, process_tree

HEALTH_CHECK = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3",
                "RAY_health_check_initial_delay_ms": "1000"}  # fmt: skip


class RayNode:
    """One ``ray start --block`` process and what it starts."""

    def __init__(self, arguments: list[str], env: dict[str, str], log: Path) -> None:
        ray = str(Path(sys.executable).with_name("ray"))
        self.log = log
        with open(log, "wb") as output:
            self.process = subprocess.Popen([ray, "start", *arguments, "--block"], env=env, stdout=output,
                                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def kill(self) -> None:
        """SIGKILL to every process of the node, as a machine lost at once."""
        end_processes(process_tree(self.process.pid), grace_seconds=0)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM (``ray start --block`` stops its processes), then SIGKILL to whatever is left of the tree."""
        if self.process.poll() is None:
            left = process_tree(self.process.pid)
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
            end_processes(left, grace_seconds=0)
            self.process.wait(timeout=30)


class TwoNodes:
    """A head node and a worker node with ``cpus`` CPUs each; ``env`` is what a driver needs to connect
    (``ray.init(address=cluster.address)`` with ``env`` in ``os.environ``)."""

    def __init__(self, directory: Path, cpus: int = 1) -> None:
        self.directory = directory
        self.port = free_port()
        self.cpus = cpus
        # the driver's Ray reads its auth mode once, when imported (before any fixture runs): the nodes use the mode a
        # driver has by default (no token); they listen on this machine only for the test's length
        self.env = {"RAY_AUTH_MODE": "disabled"}
        self.head: RayNode | None = None
        self.worker: RayNode | None = None
        self.temp: str | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> TwoNodes:
        self.directory.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env, **HEALTH_CHECK}
        env.pop("RAY_ADDRESS", None)
        common = ["--node-ip-address", "127.0.0.1", "--num-cpus", str(self.cpus), "--disable-usage-stats",
                  "--dashboard-agent-listen-port", "0", "--min-worker-port", "0", "--max-worker-port", "0"]  # fmt: skip
        # Ray's sockets live under its temp folder, and a socket's path has at most 107 bytes: a short one
        self.temp = tempfile.mkdtemp(prefix="tsray-")
        self.head = RayNode(["--head", "--port", str(self.port), "--include-dashboard", "false", "--temp-dir",
                             self.temp, *common], env, self.directory / "head.log")  # fmt: skip
        self._wait_for("Ray runtime started", self.head, timeout)
        self.worker = RayNode(["--address", self.address, *common], env, self.directory / "worker.log")
        self._wait_for("Ray runtime started", self.worker, timeout)
        return self

    def _wait_for(self, line: str, node: RayNode, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while line not in node.log.read_text(errors="replace"):
            if node.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"ray start did not come up: {node.log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.2)

    def kill_worker(self) -> None:
        assert self.worker is not None
        self.worker.kill()

    def stop(self) -> None:
        for node in (self.worker, self.head):
            if node is not None:
                node.stop()
        if self.temp is not None:
            shutil.rmtree(self.temp, ignore_errors=True)


@contextmanager
def serving(nodes: TwoNodes, application: object) -> Iterator[str]:
    """A driver connected to ``nodes`` (their ``env`` in ``os.environ`` meanwhile) serving the Ray Serve
    ``application`` (``build_fleet(...)``) as tierserve's fleet app; yields its base URL. One HTTP proxy, on the
    head: two nodes on one machine cannot both listen on the port. Serve, the driver and the environment are
    put back on exit (the nodes are the caller's to stop)."""
    import ray
    from ray import serve

    from tierserve.fleet.app import APP_NAME

    saved = {name: os.environ.get(name) for name in nodes.env}
    os.environ.update(nodes.env)
    try:
        ray.init(address=nodes.address, log_to_driver=False)
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(application, name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
