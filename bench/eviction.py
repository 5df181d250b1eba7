"""Eviction policy benchmark: hit rates on synthetic traces, and op throughput.

Run from the repository root::

    .venv/bin/python -m bench.eviction

Every eviction policy in the plugin registry is measured (built-ins and any
installed plugin allowed by ``TIERSERVE_PLUGINS``), each built through its
registered factory exactly as a cache tier builds it.

It prints two markdown tables:

* **Hit rate**: one row per trace (``mixed``, ``recency``, ``frequency`` from
  ``bench/eviction_traces.py``) and cache capacity (100, 200, 400 unit-size
  entries), one column per policy. Each cell is the fraction of accesses that
  hit when the trace is replayed with ``bench.eviction_traces.replay`` (a hit
  touches, a miss inserts and evicts back down to capacity). The traces are
  seeded, so hit rates are exactly reproducible.
* **Throughput**: accesses per second replaying the ``mixed`` trace at
  capacity 200 (best of several runs, this process, this machine), and that
  figure as a ratio to ``lru``'s. Absolute numbers depend on the machine;
  the ratio is the comparable part.

The whole run takes a few seconds.
"""

from __future__ import annotations

import gc
import platform
import sys
import time
from collections.abc import Hashable, Sequence

from bench.eviction_traces import TRACES, replay
from tierserve.core.plugins import load_plugins

CAPACITIES = (100, 200, 400)
THROUGHPUT_TRACE = "mixed"
THROUGHPUT_CAPACITY = 200
THROUGHPUT_REPEATS = 3
BASELINE = "lru"


def measure_throughput(factory, trace: Sequence[Hashable], capacity: int, repeats: int) -> float:
    """Best-of-``repeats`` accesses per second replaying ``trace`` on a fresh policy."""
    best = float("inf")
    for _ in range(repeats):
        policy = factory(capacity)
        gc.collect()
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            start = time.perf_counter()
            replay(policy, trace, capacity)
            best = min(best, time.perf_counter() - start)
        finally:
            if gc_was_enabled:
                gc.enable()
    return len(trace) / best


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    align = ["---"] + ["---:"] * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def main() -> int:
    manager = load_plugins()
    registry = manager.registry("eviction_policies")
    components = list(registry)  # sorted by name
    if not components:
        print("no eviction policies registered", file=sys.stderr)
        return 1
    for failure in manager.failures:
        print(f"plugin failed to load: {failure.name} ({failure.source}): {failure.error}", file=sys.stderr)

    traces = {name: make() for name, make in TRACES.items()}
    names = [c.name for c in components]
    errors: dict[str, str] = {}

    hit_rows = []
    for trace_name, trace in traces.items():
        for capacity in CAPACITIES:
            row = [trace_name, str(capacity)]
            for component in components:
                if component.name in errors:
                    row.append("error")
                    continue
                try:
                    rate = replay(component.factory(capacity), trace, capacity)
                except Exception as exc:  # a broken plugin policy must not sink the run
                    errors[component.name] = f"{type(exc).__name__}: {exc}"
                    row.append("error")
                    continue
                row.append(f"{rate:.3f}")
            hit_rows.append(row)

    throughput: dict[str, float] = {}
    trace = traces[THROUGHPUT_TRACE]
    for component in components:
        if component.name in errors:
            continue
        throughput[component.name] = measure_throughput(
            component.factory, trace, THROUGHPUT_CAPACITY, THROUGHPUT_REPEATS
        )
    baseline = throughput.get(BASELINE)

    print(f"# Eviction policies ({platform.python_implementation()} {platform.python_version()})")
    print()
    print("## Hit rate (higher is better)")
    print()
    print(markdown_table(["trace", "capacity", *names], hit_rows))
    print()
    print(
        f"## Throughput: {THROUGHPUT_TRACE} trace ({len(trace):,} accesses), "
        f"capacity {THROUGHPUT_CAPACITY}, best of {THROUGHPUT_REPEATS}"
    )
    print()
    tp_rows = []
    for name in names:
        if name not in throughput:
            tp_rows.append([name, "error", "error"])
            continue
        ratio = f"{throughput[name] / baseline:.2f}" if baseline else "n/a"
        tp_rows.append([name, f"{throughput[name]:,.0f}", ratio])
    print(markdown_table(["policy", "accesses/s", f"vs {BASELINE}"], tp_rows))
    for name, error in errors.items():
        print(f"\npolicy {name!r} failed: {error}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
