"""A prompt warm with write-through tiers waits for its own writes and reports them.

Regression for the warm that dropped most of its L3 writes (the write queue
was full) while reporting every block warmed: after a restart only a few of
the warmed prompts were cached.
"""

from __future__ import annotations

import httpx
import pytest

from tests.engine_helpers import build_checkpoint, make_engine
from tests.server_helpers import running_server
from tierserve.settings.config import load_settings
from tierserve.core.sampling_params import SamplingParams

pytestmark = pytest.mark.integration

BLOCK = 4
PROMPTS = [f"Warm prompt {n}: a context of its own, several blocks long, about item {n * 37}." for n in range(40)]
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def tier_values(tmp_path) -> dict[str, object]:
    """A persistent L3 (written through) behind a write queue far shorter than a warm's blocks."""
    l3 = {"name": "l3", "plugin": "disk", "path": str(tmp_path / "l3"), "persistent": True, "write_through": True}
    return {"kv_cache__block_size": BLOCK, "kv_cache__tiers": [l3 | {"write_queue": 2}]}


def test_every_warmed_prompt_is_on_disk_after_a_restart_and_the_response_counts_the_writes(tmp_path):
    path = build_checkpoint(tmp_path, "m", "llama")
    values = tier_values(tmp_path)
    overrides = {tuple(name.split("__")): value for name, value in values.items()}
    overrides |= {("model", "path"): str(path), ("model", "device"): "cpu"}
    loaded = load_settings(None, environ={}, overrides=overrides)
    engine = make_engine(path, **values)
    try:
        with running_server(loaded.settings, engine=engine, plugins=loaded.plugins) as base:
            reply = httpx.post(f"{base}/v1/cache/warm", json={"prompts": PROMPTS}, timeout=600)
            assert reply.status_code == 200, reply.text
        written_through = engine.stats().cache.write_through
    finally:
        engine.close()

    again = make_engine(path, **values)  # a restart on the same directory
    try:
        on_disk = again.stats().cache.tiers["l3"].entries
        results = again.generate(PROMPTS, ONE_TOKEN)
        for prompt, result in zip(PROMPTS, results, strict=True):
            usable = (len(again.encode_prompt(prompt)) - 1) // BLOCK * BLOCK
            assert result.cached_tokens == usable, prompt  # every block from L3
        assert again.stats().cache.promotions["l3"] > 0
    finally:
        again.close()

    warmed = reply.json()
    assert warmed["source"] == "prompts" and warmed["warmed"] == len(PROMPTS)
    assert warmed["blocks"] == warmed["tokens"] // BLOCK > 0
    assert warmed["writes"] == {"l3": {"written": written_through, "dropped": 0, "pending": 0}}
    assert written_through == on_disk


def test_a_warm_out_of_time_counts_what_it_dropped(tmp_path):
    path = build_checkpoint(tmp_path, "m", "llama")
    engine = make_engine(path, **tier_values(tmp_path), kv_cache__warm_write_timeout_seconds=1e-6)
    try:
        warmed = engine.warm(PROMPTS[:8])
        engine.flush_cache()
        stats = engine.stats().cache
        l3 = warmed.writes["l3"]
        assert l3["dropped"] > 0  # no time to wait for room: a full queue drops, as for any request
        assert l3["written"] + l3["dropped"] + l3["pending"] == stats.write_through
        assert l3["dropped"] == stats.tiers["l3"].dropped_writes and stats.tiers["l3"].entries >= l3["written"]
    finally:
        engine.close()
