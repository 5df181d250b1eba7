"""Plugin faults are contained: a cache tier, an eviction policy, a speculator or a scheduler that raises, each
installed as an outside plugin would be.

A tier (or the eviction policy inside it) that raises is a miss or a dropped write, counted in its ``errors``,
backed off and reported as a degraded cache on ``/health``; the requests are served as without it. A
speculator that raises is dropped for the requests it drafted for, which decode on (``speculation.errors``).
A scheduler that raises fails the requests of that step with a 500 naming it, and the engine serves the next
request. After each, the block pool, the hash index and the tiers pass their integrity checks with every block
free.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from litestar.testing import TestClient
from structlog.testing import capture_logs

from tests.engine_helpers import PROMPTS, assert_pool_released, build_checkpoint
from tierserve.cache.tier import CacheEntry
from tierserve.core.hookspecs import hookimpl
from tierserve.core.plugins import load_plugins
from tierserve.core.sampling_params import SamplingParams
from tierserve.core.speculation import Speculator
from tierserve.engine import EngineClient
from tierserve.plugins.backends.native import NativeBackend
from tierserve.plugins.eviction.lru import LRUPolicy
from tierserve.plugins.schedulers.fcfs import FCFSScheduler
from tierserve.plugins.tiers.memory import MemoryTier, MemoryTierSettings
from tierserve.settings.config import load_settings

pytestmark = pytest.mark.integration

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LONG = [PROMPTS[i] * 6 for i in range(4)]  # ~11 blocks each: an L1 of 16 blocks evicts them into L2


class FlakySettings(MemoryTierSettings):
    """``[[kv_cache.tiers]]`` options of the ``flaky`` tier: a memory tier's."""


class MangledSettings(MemoryTierSettings):
    """``[[kv_cache.tiers]]`` options of the ``mangled`` tier: a memory tier's."""


class FlakyTier(MemoryTier):
    """A memory tier whose reads and writes raise while ``FlakyTier.broken`` is set."""

    broken = True
    calls = 0

    def _maybe_fail(self) -> None:
        FlakyTier.calls += 1
        if FlakyTier.broken:
            raise RuntimeError("flaky tier: the backing store is gone")

    def get(self, key: bytes) -> CacheEntry | None:
        self._maybe_fail()
        return super().get(key)

    def get_many(self, keys: list[bytes]) -> list[CacheEntry]:
        self._maybe_fail()
        return super().get_many(keys)

    def put(self, entry: CacheEntry) -> list[CacheEntry]:
        self._maybe_fail()
        return super().put(entry)

    def put_many(self, entries: list[CacheEntry]) -> list[CacheEntry]:
        self._maybe_fail()
        return super().put_many(entries)


class MangledTier(MemoryTier):
    """A memory tier that hands back every entry with its KV cut in half (a plugin's decoding bug)."""

    def get(self, key: bytes) -> CacheEntry | None:
        entry = super().get(key)
        if entry is not None:
            entry.kv = entry.kv[..., : entry.kv.shape[-1] // 2].contiguous()
        return entry

    def get_many(self, keys: list[bytes]) -> list[CacheEntry]:
        return [self.get(key) for key in keys if self.contains(key)]


class GrumpyPolicy(LRUPolicy):
    """LRU that raises on every insert."""

    def insert(self, key, size: int = 1) -> None:
        raise ValueError("grumpy policy: no room for anyone")


class BrokenSpeculator(Speculator):
    """Proposes nothing: it raises."""

    def __init__(self, settings, target) -> None:
        self.calls = 0

    def propose(self, requests):
        self.calls += 1
        raise KeyError("broken speculator: lost its n-gram table")


class BrokenBackend(NativeBackend):
    """The native backend, whose third forward raises."""

    forwards = 0

    def forward(self, chunks):
        BrokenBackend.forwards += 1
        if BrokenBackend.forwards == 3:
            raise RuntimeError("broken backend: the device fell off the bus")
        return super().forward(chunks)


class StumblingScheduler(FCFSScheduler):
    """FCFS that raises once, on its fourth schedule."""

    schedules = 0

    def schedule(self):
        StumblingScheduler.schedules += 1
        if StumblingScheduler.schedules == 4:
            raise IndexError("stumbling scheduler: lost its place in the queue")
        return super().schedule()


@hookimpl
def register_cache_tiers(register):
    register("flaky", FlakyTier, settings=FlakySettings, description="a memory tier that raises (tests)")
    register("mangled", MangledTier, settings=MangledSettings, description="a memory tier that garbles (tests)")


@hookimpl
def register_eviction_policies(register):
    register("grumpy", GrumpyPolicy, description="LRU that raises on insert (tests)")


@hookimpl
def register_speculators(register):
    register("broken", BrokenSpeculator, description="a speculator that raises (tests)")


@hookimpl
def register_backends(register):
    register("broken", BrokenBackend, description="native, whose third forward raises (tests)")


@hookimpl
def register_schedulers(register):
    register("stumbling", StumblingScheduler, description="FCFS that raises once (tests)")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("faults"), "llama", "llama", max_position_embeddings=1024)


def engine_with(path, **settings) -> tuple[EngineClient, object]:
    plugins = load_plugins(allowlist=[])
    hooks = SimpleNamespace(register_cache_tiers=register_cache_tiers, register_eviction_policies=register_eviction_policies,
                            register_speculators=register_speculators, register_schedulers=register_schedulers,
                            register_backends=register_backends)  # fmt: skip
    plugins.add_plugin(hooks, "tierserve-faulty-test-plugins", "0", "tests")
    overrides = {("model", "path"): str(path), ("model", "device"): "cpu", ("server", "engine_process"): False,
                 ("logging", "level"): "warning"}  # fmt: skip
    for dotted, value in settings.items():
        section, key = dotted.split("__")
        overrides[(section, key)] = value
    loaded = load_settings(None, environ={}, overrides=overrides, plugins=plugins)
    return EngineClient.from_settings(loaded.settings, plugins, process=False), loaded


@pytest.fixture(scope="module")
def reference(llama):
    """What the prompts generate with no lower tier, no speculation and the built-in scheduler."""
    engine, _ = engine_with(llama)
    try:
        return [result.token_ids for result in engine.generate(LONG, GREEDY)]
    finally:
        engine.close()


@pytest.mark.parametrize("faulty", ["tier", "policy"])
def test_a_raising_tier_is_a_miss_counted_backed_off_and_degraded(llama, reference, faulty):
    """Its reads and writes raise (or its eviction policy's inserts do): every request is answered as without the
    tier, the faults are counted in its ``errors`` and logged with the plugin and a traceback, ``/health`` says
    the cache is degraded, and the pool, the index and the tiers are whole afterwards."""
    from tierserve.server.app import create_app

    FlakyTier.broken, FlakyTier.calls = faulty == "tier", 0
    tier = {"name": "l2", "plugin": "flaky", "capacity": 64, "eviction_policy": "grumpy" if faulty == "policy" else "lru"}
    engine, loaded = engine_with(llama, kv_cache__l1_capacity=16, kv_cache__tiers=[tier])
    app = create_app(loaded.settings, engine=engine, plugins=loaded.plugins, load_in_background=False)
    try:
        with TestClient(app) as http, capture_logs() as logs:
            for _ in range(2):  # the second round asks the tier for what the first evicted into it
                assert [r.token_ids for r in engine.generate(LONG, GREEDY)] == reference
            tiers = engine.stats().cache.tiers
            assert tiers["l2"].errors >= 1
            failed = [e for e in logs if e["event"] == "cache_tier_failed"]
            assert failed and failed[0]["plugin"] == "tierserve-faulty-test-plugins" and failed[0]["exc_info"]
            # backed off: far fewer failures logged than calls the store would have made
            assert len(failed) <= 2, [e["method"] for e in failed]
            health = http.get("/health").json()
            assert health["details"]["components"]["cache_system"] == "degraded"
            assert http.get("/v1/cache/stats").json()["cache_manager"]["kv_cache"]["tiers"]["l2"]["errors"] >= 1
            assert http.post("/v1/completions", json={"prompt": LONG[0], "max_tokens": 4}).status_code == 200
        assert_pool_released(engine)
    finally:
        engine.close()
        FlakyTier.broken = True


def test_entries_the_arena_cannot_take_are_computed_and_leave_no_block_held(llama, reference):
    """A tier that returns blocks of the wrong shape: loading them into L1 fails, the blocks taken for them go
    back to the pool (they used to stay in use for good) and the prompt computes what it could not load."""
    engine, _ = engine_with(llama, kv_cache__l1_capacity=16,
                            kv_cache__tiers=[{"name": "l2", "plugin": "mangled", "capacity": 64}])  # fmt: skip
    try:
        with capture_logs() as logs:
            for _ in range(2):
                assert [r.token_ids for r in engine.generate(LONG, GREEDY)] == reference
        assert any(e["event"] == "promote_failed" for e in logs)
        assert_pool_released(engine)
    finally:
        engine.close()


def test_a_tier_that_recovers_is_used_again(llama, reference):
    """The first call after the back-off tries the tier again; once it works the blocks flow into it again."""
    import time

    FlakyTier.broken = True
    engine, _ = engine_with(llama, kv_cache__l1_capacity=16,
                            kv_cache__tiers=[{"name": "l2", "plugin": "flaky", "capacity": 64}])  # fmt: skip
    try:
        assert [r.token_ids for r in engine.generate(LONG[:2], GREEDY)] == reference[:2]
        FlakyTier.broken = False
        time.sleep(1.1)  # past the first back-off
        for _ in range(2):
            assert [r.token_ids for r in engine.generate(LONG, GREEDY)] == reference
        l2 = engine.stats().cache.tiers["l2"]
        assert l2.entries > 0 and l2.hits > 0
        assert_pool_released(engine)
    finally:
        engine.close()
        FlakyTier.broken = True


def test_a_raising_speculator_is_dropped_for_its_requests(llama, reference):
    with capture_logs() as logs:
        engine, _ = engine_with(llama, speculative__method="broken")
        try:
            assert [r.token_ids for r in engine.generate(LONG, GREEDY)] == reference
            speculation = engine.stats().speculation
            assert speculation.errors >= 1 and speculation.verifications == 0
            assert_pool_released(engine)
        finally:
            engine.close()
    failed = [e for e in logs if e["event"] == "speculator_failed"]
    assert failed and failed[0]["speculator"] == "broken" and failed[0]["exc_info"]


def test_a_raising_scheduler_fails_that_steps_requests_with_a_500_naming_it(llama, reference):
    """Its fourth ``schedule`` raises: the request running then ends with a 500 that names the plugin's class (a
    stream: an error event), the log has the traceback, and the engine serves the next request in full."""
    from tierserve.server.app import create_app

    StumblingScheduler.schedules = 0
    engine, loaded = engine_with(llama, scheduler__name="stumbling")
    app = create_app(loaded.settings, engine=engine, plugins=loaded.plugins, load_in_background=False)
    try:
        with TestClient(app) as http, capture_logs() as logs:
            body = {"prompt": LONG[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            failed = http.post("/v1/completions", json=body)
            assert failed.status_code == 500, failed.text
            error = failed.json()["error"]
            assert error["code"] == "engine_fault"
            named = f"the scheduler plugin {StumblingScheduler.__module__}.StumblingScheduler raised IndexError"
            assert named in error["message"]
            served = http.post("/v1/completions", json=body)
            assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 12
        assert any(e["event"] == "engine_step_failed" and e["exc_info"] for e in logs)
        assert_pool_released(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("faulty", ["backend", "l1 policy"])
def test_a_raising_backend_or_l1_policy_fails_that_step_naming_where(llama, faulty):
    """A backend whose forward raises, or an eviction policy over L1 that raises: the request of that step ends
    with a 500 naming the part of the step and the code that raised; the next request is served."""
    from tierserve.server.app import create_app

    BrokenBackend.forwards = 0
    settings = {"model__backend": "broken"} if faulty == "backend" else {"kv_cache__eviction_policy": "grumpy"}
    engine, loaded = engine_with(llama, **settings)
    app = create_app(loaded.settings, engine=engine, plugins=loaded.plugins, load_in_background=False)
    try:
        with TestClient(app) as http:
            body = {"prompt": LONG[0], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            failed = http.post("/v1/completions", json=body)
            assert failed.status_code == 500, failed.text
            message = failed.json()["error"]["message"]
            if faulty == "backend":
                assert f"the backend plugin {BrokenBackend.__module__}.BrokenBackend raised RuntimeError" in message
                assert "BrokenBackend.forward" in message
            else:
                assert "GrumpyPolicy.insert" in message, message
                return  # every registration raises: this engine cannot cache a block
            served = http.post("/v1/completions", json=body)
            assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 8
        assert_pool_released(engine)
    finally:
        engine.close()
