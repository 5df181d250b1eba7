"""Waiting in tests for something to happen: poll a condition until it holds, with a deadline, never a fixed sleep.

A fixed sleep is too short on a loaded CI machine and too long everywhere else; ``wait_until`` returns as
soon as the condition holds and fails the test, naming what it waited for, once the deadline passes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout: float = 10.0, interval: float = 0.02, what: str = "") -> T:
    """Call ``condition`` every ``interval`` seconds until it returns something truthy, and return that.

    Args:
        condition: called at least once; its own slow calls count towards ``timeout``.
        timeout: seconds to keep trying; then the test fails with an ``AssertionError``.
        interval: seconds between calls.
        what: the condition in words, for the failure message (default: the function's name).

    Returns:
        The first truthy value ``condition`` returned (a response, a list of records, ``True``).
    """
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what or condition.__name__}")
        time.sleep(interval)
