"""The processes a fleet started on this machine, so that stopping it leaves none behind.

``ray.shutdown`` stops the local cluster's own processes, but helpers a
raylet started (its dashboard agent, its runtime-env agent) were seen to
outlive a ``tierserve fleet`` stopped by SIGTERM. ``process_tree`` lists a
process and everything below it (from ``/proc``), taken before shutting
down; ``end_processes`` gives what is left of that list a grace period and
then SIGKILLs it, by PID.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it, parents first (empty where ``/proc`` is not available)."""
    children: dict[int, list[int]] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended while listed
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    tree, queue = [], [root]
    while queue:
        pid = queue.pop(0)
        tree.append(pid)
        queue.extend(children.get(pid, []))
    return tree


def alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie, ended but not yet reaped, is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def end_processes(pids: list[int], grace_seconds: float = 10.0) -> list[int]:
    """Wait up to ``grace_seconds`` for ``pids`` to end, then SIGKILL those still running; returns those killed."""
    deadline = time.monotonic() + grace_seconds
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    killed = []
    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed
