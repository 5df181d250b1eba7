"""The engine core's contract with the world: one thread owns its state, and statistics never wait for a step.

Regression tests for two defects of the single-object engine: ``submit`` wrote
the request table on the caller's thread while the step thread iterated it
(a "dictionary changed size during iteration" aborted every running request),
and every statistics read ran on the step thread, so a stats request or a
Prometheus scrape waited for the current step (and delayed the next).
"""

from __future__ import annotations

import sys
import threading
from types import SimpleNamespace

import pytest

from tests.engine_helpers import PROMPTS, assert_pool_released, build_checkpoint, hf_greedy, make_engine
from tierserve.engine import EngineClient
from tierserve.settings.config import load_settings
from tierserve.core.hookspecs import hookimpl
from tierserve.core.plugins import load_plugins
from tierserve.core.sampling_params import SamplingParams
from tierserve.plugins.backends.native import NativeBackend

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("core"), "llama", "llama")


class OwnedByOneThread(dict):
    """A dict that records every access from a thread other than its owner."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.owner: threading.Thread | None = None
        self.foreign: list[str] = []

    def _check(self, what: str) -> None:
        if self.owner is not None and threading.current_thread() is not self.owner:
            self.foreign.append(f"{what} from {threading.current_thread().name}")

    def __setitem__(self, key, value) -> None:
        self._check("set")
        super().__setitem__(key, value)

    def __delitem__(self, key) -> None:
        self._check("del")
        super().__delitem__(key)

    def pop(self, *args):
        self._check("pop")
        return super().pop(*args)

    def values(self):
        self._check("values")
        return super().values()

    def __iter__(self):
        self._check("iter")
        return super().__iter__()


def test_only_the_core_thread_touches_engine_state_under_concurrent_submits(llama):
    """Four threads submit and abort while ngram speculation iterates the running requests every step."""
    expected = hf_greedy(llama, PROMPTS[:4], GREEDY.max_tokens)
    engine = make_engine(llama, speculative__method="ngram", scheduler__max_num_seqs=64)
    core = engine.driver.core  # white-box: watch the core's request table
    table = OwnedByOneThread()
    core.requests = table
    engine.start()
    table.owner = engine.driver._thread
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show up at once
    results: dict[int, tuple[list[int], str, int]] = {}
    aborted: set[str] = set()

    def client(worker: int) -> None:
        for round_ in range(6):
            index = (worker + round_) % 4
            ids = engine.encode_prompt(PROMPTS[index])
            request_id, stream = engine.submit(ids, GREEDY)
            extra, _ = engine.submit(ids, GREEDY)  # a second request, aborted at once
            engine.abort(extra)
            aborted.add(extra)
            tokens, reason = [], None
            while reason is None:
                out = stream.get(timeout=120)
                tokens += out.token_ids
                reason = out.finish_reason
            results[worker * 100 + round_] = (tokens, reason, index)

    try:
        threads = [threading.Thread(target=client, args=(w,)) for w in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
    finally:
        sys.setswitchinterval(switch)
    assert len(results) == 24
    assert not table.foreign, table.foreign[:5]
    for tokens, reason, index in results.values():
        assert reason == "length", "a request was ended by something other than its own length"
        assert tokens == expected[index]
    engine.shutdown()
    assert engine.stats().counters.requests_aborted == len(aborted)
    assert_pool_released(engine)


class GatedBackend(NativeBackend):
    """The native backend, whose forward can be held at a gate (to hold the step thread mid-step)."""

    gate: threading.Event | None = None
    entered = threading.Event()

    def forward(self, chunks):
        gate = type(self).gate
        if gate is not None:
            type(self).entered.set()
            gate.wait(timeout=60)
        return super().forward(chunks)


@hookimpl
def register_backends(register):
    register("gated", GatedBackend, description="native, with a gate in forward (tests)")


def test_statistics_never_wait_for_a_step(llama):
    """With the step thread held inside a forward, stats, Prometheus and /health still answer at once."""
    from litestar.testing import TestClient

    from tierserve.server.app import create_app

    plugins = load_plugins(allowlist=[])
    plugins.add_plugin(SimpleNamespace(register_backends=register_backends), "gated-backend", "0", "test")
    overrides = {("model", "path"): str(llama), ("model", "backend"): "gated", ("model", "device"): "cpu"}
    loaded = load_settings(None, environ={}, overrides=overrides, plugins=plugins)
    engine = EngineClient.from_settings(loaded.settings, plugins, process=False)
    engine.generate([PROMPTS[1]], GREEDY)  # statistics with something in them
    before = engine.stats()
    gate = threading.Event()
    GatedBackend.gate, GatedBackend.entered = gate, threading.Event()
    app = create_app(loaded.settings, engine=engine, plugins=plugins, load_in_background=False)
    try:
        with TestClient(app) as http:
            request_id, stream = engine.submit(engine.encode_prompt(PROMPTS[2]), GREEDY)
            assert GatedBackend.entered.wait(timeout=30), "the step never reached the forward"
            answered: dict[str, object] = {}

            def read_stats() -> None:
                answered["snapshot"] = engine.stats()
                answered["http"] = http.get("/v1/cache/stats").status_code
                answered["metrics"] = http.get("/metrics").status_code
                answered["health"] = http.get("/health").status_code

            reader = threading.Thread(target=read_stats)
            reader.start()
            reader.join(timeout=10)
            blocked = reader.is_alive()
            gate.set()  # let the step finish either way, so nothing hangs
            reader.join(timeout=30)
            assert not blocked, "reading statistics waited for the step thread"
            assert answered == {"snapshot": answered["snapshot"], "http": 200, "metrics": 200, "health": 200}
            assert answered["snapshot"].counters.generation_tokens >= before.counters.generation_tokens
            while not (out := stream.get(timeout=60)).finished:
                pass
            assert out.finish_reason == "length"
    finally:
        GatedBackend.gate = None
        gate.set()
        engine.close()


def test_a_request_the_core_cannot_admit_ends_alone(llama, monkeypatch):
    """A request that raises inside the core (found by the API fuzzer: a 65-bit seed) ends as aborted;
    the core goes on serving everything else."""
    engine = make_engine(llama)
    engine.start()
    core = engine.driver.core  # white-box: make admission fail for one request
    admit = core.add_request

    def add_request(request):
        if request.request_id == "poison":
            raise ValueError("Overflow when unpacking long long")
        return admit(request)

    monkeypatch.setattr(core, "add_request", add_request)
    _, poisoned = engine.submit(engine.encode_prompt(PROMPTS[0]), GREEDY, request_id="poison")
    assert poisoned.get(timeout=60).finish_reason == "abort"
    [after] = engine.generate([PROMPTS[1]], GREEDY)
    assert after.finish_reason == "length" and after.token_ids == hf_greedy(llama, [PROMPTS[1]], GREEDY.max_tokens)[0]
    engine.close()


def test_a_seed_torch_cannot_take_is_refused_with_the_field():
    with pytest.raises(ValueError, match=r"^seed: got 106853853254622052352, allowed: an integer from -2\*\*63"):
        SamplingParams(seed=106853853254622052352)
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1


@pytest.mark.parametrize("profiling", [True, False], ids=["profiling-on", "profiling-off"])
def test_detailed_profiling_times_every_phase_and_exports_them(llama, profiling):
    """``[monitoring] detailed_profiling``: per-phase step timings in the snapshot and on /metrics, or neither."""
    from litestar.testing import TestClient

    from tierserve.engine.profiling import CLIENT_PHASES, CORE_PHASES
    from tierserve.server.app import create_app

    engine = make_engine(llama, monitoring__detailed_profiling=profiling)
    for _ in range(2):  # the second round finds its prompts cached
        engine.generate(PROMPTS[:3], GREEDY)
    snapshot = engine.stats()
    with TestClient(create_app(engine.settings, engine=engine, load_in_background=False)) as http:
        metrics = http.get("/metrics").text
        document = http.get("/v1/cache/stats").json()["cache_manager"]
    engine.close()
    if not profiling:
        assert snapshot.profiling is None
        assert "tierserve_step_phase_seconds" not in metrics and "profiling" not in document
        return
    assert set(document["profiling"]) == {*CORE_PHASES, *CLIENT_PHASES}
    assert all(phase["count"] > 0 for phase in document["profiling"].values())
    phases = snapshot.profiling.phases()
    assert list(phases) == [*CORE_PHASES, *CLIENT_PHASES]
    for name, stats in phases.items():
        assert stats.count > 0 and stats.seconds > 0, name
        assert f'tierserve_step_phase_seconds_count{{phase="{name}"}} {float(stats.count)}' in metrics
        assert f'tierserve_step_phase_seconds_bucket{{le="+Inf",phase="{name}"}} {float(stats.count)}' in metrics
    assert phases["forward"].count == phases["sample"].count == snapshot.counters.steps
