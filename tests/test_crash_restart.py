"""A server SIGKILLed at random moments restarts on its L3 directory: exact outputs, prefixes served from disk.

The long variant is ``python -m bench.soak_crash --iterations 100``.
"""

from __future__ import annotations

import pytest

from bench.soak_crash import soak

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ITERATIONS = 5  # ~11 s each on 2 cores; the soak runs 100


def test_sigkill_restarts_serve_exact_outputs_from_l3(tmp_path):
    result = soak(tmp_path, ITERATIONS, seed=0, tear_every=4)
    print(result.summary())

    assert result.kills_survived == ITERATIONS
    assert result.mismatches == []
    # The first life may be killed before its writes reach the disk; after that the probe's prefix is stored.
    assert result.restarts_with_l3_hits >= ITERATIONS - 2, [r.l3_hits for r in result.restarts]
    # Each torn value file lies on the probe's prefix, so the probe reads it: counted as corrupt, never served.
    assert result.corrupt_detected >= result.torn_injected > 0
