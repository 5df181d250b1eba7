"""The example plugins' own tests, written with ``tierserve.testing`` as any plugin's would be."""

from __future__ import annotations

import queue

import tierserve_example_plugin
from tierserve_example_plugin import FifoPolicy
from tierserve_example_plugin import scheduler as sjf_module
from tierserve_example_plugin.scheduler import ShortestPromptFirst

from tierserve.core.sampling_params import SamplingParams
from tierserve.testing import check_eviction_policy, check_scheduler

PROMPTS = ["a much longer prompt than the others, " * 4, "mid-sized prompt here", "hi"]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_fifo_keeps_the_eviction_rules():
    check_eviction_policy(FifoPolicy)


def test_fifo_evicts_in_insertion_order_whatever_the_hits():
    policy = FifoPolicy(capacity=4)
    for key in "abcd":
        policy.insert(key)
    policy.touch("a")  # FIFO ignores hits
    policy.pin("b")  # pinned entries are never victims
    assert [policy.evict(), policy.evict(), policy.evict(), policy.evict()] == ["a", "c", "d", None]


def test_sjf_keeps_the_scheduler_rules():
    check_scheduler(ShortestPromptFirst)


def test_sjf_serves_the_shortest_prompt_first(tierserve_plugins, tierserve_engine):
    plugins = tierserve_plugins(tierserve_example_plugin, sjf_module)
    engine = tierserve_engine({"scheduler.name": "sjf", "scheduler.max_num_seqs": 1, "kv_cache.block_size": 4}, plugins)
    submitted = [engine.submit(engine.encode_prompt(p), GREEDY) for p in PROMPTS]
    order = []
    while engine.has_work():
        engine.step()
        for index, (_, stream) in enumerate(submitted):
            try:
                while True:
                    if stream.get(timeout=0).finished:
                        order.append(index)
            except queue.Empty:
                pass
    assert order == [2, 1, 0]


def test_fifo_serves_over_http(tierserve_plugins, tierserve_client):
    settings = {"kv_cache.eviction_policy": "fifo", "kv_cache.block_size": 4, "kv_cache.l1_capacity": 14}
    client = tierserve_client(settings, tierserve_plugins(tierserve_example_plugin))
    for prompt in PROMPTS * 2:
        response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
        assert response.status_code == 200, response.text
    assert client.get("/v1/cache/stats").json()["cache_manager"]["kv_cache"]["evictions"] > 0
