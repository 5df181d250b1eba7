"""Plugins publish figures of their own: declared on ``self.figures``, read with the engine's statistics, shown
in ``/v1/cache/stats`` under ``plugin_figures`` and in ``/metrics``; a bad declaration is refused, a failing
gauge costs only itself."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from tierserve.cache.figures import Figures
from tierserve.core.sampling_params import SamplingParams
from tierserve.plugins.schedulers.fcfs import FCFSScheduler
from tierserve.plugins.tiers.memory import MemoryTier, MemoryTierSettings
from tierserve.testing import component_plugin, http_client, plugin_manager, tiny_engine

pytestmark = pytest.mark.integration

PROMPTS = ["the first prompt fills several KV blocks of four tokens", "and a second one, different from the start"]


class CountingTier(MemoryTier):
    """The memory tier, counting what it is handed and reporting what it holds."""

    def __init__(self, tier, policy_factory, fingerprint):
        super().__init__(tier, policy_factory, fingerprint)
        self.stored = self.figures.counter("blocks_stored", "blocks handed to the tier")
        self.figures.gauge("blocks_held", "blocks the tier holds now", read=lambda: len(self))

    def put(self, entry):
        self.stored.inc()
        return super().put(entry)


class CountingScheduler(FCFSScheduler):
    def __init__(self, settings, kv, model=None):
        super().__init__(settings, kv, model)
        self.steps = self.figures.counter("steps", "schedule() calls")

    def schedule(self):
        self.steps.inc()
        return super().schedule()


def counting_plugins():
    return plugin_manager(
        component_plugin("cache_tiers", "counting", CountingTier, settings=MemoryTierSettings),
        component_plugin("schedulers", "counting_fcfs", CountingScheduler),
    )


SETTINGS = {
    "kv_cache.block_size": 4,
    "kv_cache.l1_capacity": 8,
    "kv_cache.tiers": [{"name": "spill", "plugin": "counting", "capacity": 64}],
    "scheduler.name": "counting_fcfs",
}


def test_a_plugins_figures_appear_in_the_stats_and_the_metrics():
    with http_client(SETTINGS, counting_plugins()) as client:
        for prompt in PROMPTS * 3:  # L1 holds one prompt's blocks: each evicts the other's into the tier
            body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
            assert client.post("/v1/completions", json=body).status_code == 200
        figures = client.get("/v1/cache/stats").json()["plugin_figures"]
        [plugin] = [name for name in figures if "spill" in figures[name]]
        spill = figures[plugin]["spill"]
        assert spill["blocks_stored"] > 0 and 0 < spill["blocks_held"] <= spill["blocks_stored"]
        [scheduler_plugin] = [name for name in figures if "counting_fcfs" in figures[name]]
        assert figures[scheduler_plugin]["counting_fcfs"]["steps"] > 0
        metrics = client.get("/metrics").text
    stored = f'tierserve_plugin_cache_tier_counting_blocks_stored_total{{instance="spill",plugin="{plugin}"}}'
    assert f"{stored} {float(spill['blocks_stored'])}" in metrics
    assert "# TYPE tierserve_plugin_cache_tier_counting_blocks_held gauge" in metrics
    assert "# HELP tierserve_plugin_scheduler_counting_fcfs_steps_total schedule() calls" in metrics


def test_components_without_figures_publish_nothing():
    with tiny_engine({"kv_cache.block_size": 4}) as engine:
        engine.generate(["Hello"], SamplingParams(max_tokens=2))
        assert engine.stats().plugin_figures == []


def test_a_failing_gauge_is_logged_and_left_out_alone():
    figures = Figures()
    counter = figures.counter("reads", "entries read")
    figures.gauge("broken", "raises", read=lambda: 1 / 0)
    counter.inc(3)
    with capture_logs() as logs:
        values = figures.values()
    assert {name: v.value for name, v in values.items()} == {"reads": 3}
    assert [e["figure"] for e in logs if e["event"] == "plugin_figure_failed"] == ["broken"]


@pytest.mark.parametrize(
    "declare, message",
    [
        (lambda f: f.counter("Reads", "x"), "use lowercase letters, digits and _"),
        (lambda f: f.counter("reads-total", "x"), "use lowercase letters, digits and _"),
        (lambda f: [f.counter("reads", "x"), f.gauge("reads", "y")], "declared twice"),
        (lambda f: f.gauge("held", " "), "needs a description"),
        (lambda f: f.counter("reads", "x").inc(-1), "a counter only grows"),
    ],
)
def test_a_bad_figure_is_refused_with_the_reason(declare, message):
    with pytest.raises(ValueError, match=message):
        declare(Figures())
