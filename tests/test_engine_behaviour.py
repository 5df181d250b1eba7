"""What a caller of the engine observes: sampling, stops, limits, aborts, back-pressure, chat."""

from __future__ import annotations

import asyncio

import pytest

from tests.engine_helpers import PROMPTS, assert_pool_released, build_checkpoint, make_engine
from tests.waiting import wait_until
from tierserve.settings.config import load_settings
from tierserve.engine import EngineClient, RequestError
from tierserve.core.sampling_params import SamplingParams
from tierserve.core.scheduler import QueueFullError

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", "llama")


@pytest.fixture
def engine(tiny):
    engine = make_engine(tiny)
    yield engine
    engine.shutdown()


def test_seeded_sampling_is_reproducible_and_independent_of_batch(engine):
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=1234, ignore_eos=True)
    [alone] = engine.generate([PROMPTS[1]], params)
    [again] = engine.generate([PROMPTS[1]], params)
    others = [SamplingParams(temperature=0.7, max_tokens=20, ignore_eos=True, seed=s) for s in range(5)]
    batch = engine.generate(PROMPTS[:5] + [PROMPTS[1]], others + [params])
    assert alone.token_ids == again.token_ids == batch[-1].token_ids
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    runs = {tuple(engine.generate([PROMPTS[1]], unseeded)[0].token_ids) for _ in range(3)}
    assert len(runs) > 1  # without a seed, sampling really is random
    assert_pool_released(engine)


def test_every_bit_of_a_64_bit_seed_counts(engine):
    """Seeds that differ only above bit 31 (torch's CPU generator keeps the low 32) draw different tokens; -1 is
    2**64 - 1, as the API documents."""
    def sampled(seed: int) -> tuple[int, ...]:
        params = SamplingParams(temperature=1.5, max_tokens=24, seed=seed, ignore_eos=True)
        return tuple(engine.generate([PROMPTS[1]], params)[0].token_ids)

    seeds = [5, 5 + 2**32, 5 + 2**63, 2**64 - 1]
    drawn = [sampled(seed) for seed in seeds]
    assert len(set(drawn)) == len(seeds)
    assert sampled(-1) == drawn[-1] and sampled(5) == drawn[0]


def test_stop_token_and_stop_string(engine):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    [full] = engine.generate([PROMPTS[4]], greedy)
    stop_token = full.token_ids[3]
    first = full.token_ids.index(stop_token)
    [stopped] = engine.generate(
        [PROMPTS[4]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_token])
    )
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == full.token_ids[: first + 1]

    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop and len(text) > 6
    expected = text[: text.index(stop)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
    [by_string] = engine.generate([PROMPTS[4]], params)
    assert by_string.finish_reason == "stop"
    assert by_string.text == expected
    assert full.finish_reason == "length" and len(full.token_ids) == 12
    assert_pool_released(engine)


def test_logprobs_of_chosen_and_top_tokens(engine):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3)
    [result] = engine.generate([PROMPTS[0]], params)
    assert len(result.logprobs) == 5
    for step, token in zip(result.logprobs, result.token_ids):
        assert step.token_id == token
        assert len(step.top_logprobs) == 3
        assert step.top_logprobs[0][0] == token  # greedy picks the most likely token
        assert step.logprob == pytest.approx(step.top_logprobs[0][1])
        assert step.logprob <= 0


def test_limits_are_reported_with_the_field(engine):
    limit = engine.info.max_model_len
    with pytest.raises(RequestError, match="max_tokens.*context length"):
        engine.submit([5] * 10, SamplingParams(max_tokens=limit))
    with pytest.raises(RequestError, match="prompt"):
        engine.submit([], SamplingParams())
    with pytest.raises(RequestError, match="token ids"):
        engine.encode_prompt([10**9])
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)


def test_the_development_preset_queues_a_burst_of_256_requests(tiny):
    """It queued 64: 100 concurrent cached completions got 33 answers of 503."""
    overrides = {("model", "path"): str(tiny), ("model", "device"): "cpu"}
    loaded = load_settings("development", environ={}, overrides=overrides)
    engine = EngineClient.from_settings(loaded.settings, loaded.plugins, process=False)
    params = SamplingParams(temperature=0, max_tokens=1)
    ids = engine.encode_prompt(PROMPTS[0])
    for _ in range(256):  # nothing steps the core, so every one of them waits
        engine.submit(ids, params)
    with pytest.raises(QueueFullError, match=r"max_waiting_requests = 256"):
        engine.submit(ids, params)
    engine.close()


def test_queue_full_is_back_pressure_and_loses_nothing(tiny):
    engine = make_engine(tiny, scheduler__max_waiting_requests=2)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    admitted = [engine.submit(engine.encode_prompt(p), params) for p in PROMPTS[:2]]
    with pytest.raises(QueueFullError):
        engine.submit(engine.encode_prompt(PROMPTS[2]), params)
    outputs = {}
    while engine.has_work():
        engine.step()
    for request_id, stream in admitted:
        outputs[request_id] = _finished_tokens(stream)
    assert all(len(tokens) == 4 for tokens in outputs.values())
    assert_pool_released(engine)


def test_abort_mid_stream_frees_blocks(engine):
    engine.start()

    async def consume_a_little() -> int:
        seen = 0
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        async for output in engine.add_request(PROMPTS[4], params):
            seen += len(output.token_ids)
            if seen >= 3:
                break  # the client goes away
        return seen

    async def run_both():
        short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        complete = []

        async def full():
            async for output in engine.add_request(PROMPTS[1], short):
                complete.extend(output.token_ids)

        seen, _ = await asyncio.gather(consume_a_little(), full())
        return seen, complete

    seen, complete = asyncio.run(run_both())
    assert seen >= 3 and len(complete) == 8
    wait_until(lambda: not engine.has_work(), what="the engine to let the left request go")
    engine.shutdown()
    assert engine.stats().counters.requests_aborted == 1
    assert_pool_released(engine)


def test_priority_scheduler_serves_urgent_requests_first(tiny):
    engine = make_engine(tiny, scheduler__name="priority", scheduler__max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    low = engine.submit(engine.encode_prompt(PROMPTS[0]), params, priority=5)
    high = engine.submit(engine.encode_prompt(PROMPTS[1]), params, priority=0)
    order = []
    while engine.has_work():
        engine.step()
        for request_id, stream in (low, high):
            try:
                while True:
                    if stream.get(timeout=0).finished:
                        order.append(request_id)
            except Exception:
                pass
    assert order == [high[0], low[0]]


def test_chat_messages_use_the_checkpoint_template(engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    ids = engine.encode_prompt(messages=messages)
    text = engine.decode(ids)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"


def test_a_prompt_waiting_for_blocks_is_looked_up_once_when_it_runs(tiny):
    """A prompt that cannot get its blocks waits without being looked up (no lookups, hits or cached tokens
    counted, no eviction order touched each step); when blocks free up it is matched once and reuses its
    cached prefix."""
    engine = make_engine(tiny, kv_cache__block_size=4, kv_cache__l1_capacity=20, kv_cache__tiers=[],
                         scheduler__max_num_batched_tokens=256)  # fmt: skip
    try:
        shared = list(range(3, 35))  # 8 blocks
        warm = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        engine.submit(shared + [40], warm)
        while engine.has_work():
            engine.step()
        before = engine.stats().cache
        hog = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        engine.submit(list(range(100, 140)), hog)  # 10 blocks growing to 12: with the 8 cached, the pool is full
        engine.step()
        _, waiting = engine.submit(shared + [41, 42, 43, 44, 45, 46, 47, 48, 49], warm)
        steps = 0
        while engine.has_work() and steps < 5:
            engine.step()
            steps += 1
        during = engine.stats().cache
        assert during.lookups == before.lookups + 1  # the hog's own lookup; the waiting prompt asked nothing
        assert during.tiers["l1"].hits == before.tiers["l1"].hits
        assert during.cached_tokens == before.cached_tokens
        while engine.has_work():
            engine.step()
        after = engine.stats().cache
        assert after.lookups == before.lookups + 2
        assert after.tiers["l1"].hits == before.tiers["l1"].hits + 8  # its prefix, counted once
        assert after.cached_tokens == before.cached_tokens + 32
        assert len(_finished_tokens(waiting)) == 1
        assert_pool_released(engine)
    finally:
        engine.close()


def test_a_prefix_read_from_a_slow_tier_does_not_stall_running_streams(tiny, tmp_path):
    """A prompt whose prefix sits only on disk waits while the store's loader thread reads it (here a disk
    that takes 0.3 s a block), and the running stream decodes meanwhile; then the prompt reuses the read
    blocks and its output is the cold run's. (A host-memory tier is read at the match: microseconds.)"""
    import threading
    import time

    tier = {"name": "l3", "plugin": "disk", "path": str(tmp_path / "l3"), "write_through": True}
    engine = make_engine(tiny, kv_cache__block_size=4, kv_cache__tiers=[tier])
    try:
        prefix = list(range(3, 35))  # 8 blocks
        greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        [cold] = engine.generate([prefix + [40]], greedy)
        engine.driver.core.scheduler.kv.store.flush()  # white-box: the write-through is on disk
        engine.clear_cache("l1")  # the prefix is now only in l3
        store_tier = engine.driver.core.scheduler.kv.store.tiers[0].tier.inner  # white-box (in its guard): slow reads
        read, reader_threads = store_tier._lookup, set()

        def slow_read(key):
            reader_threads.add(threading.current_thread().name)
            time.sleep(0.3)
            return read(key)

        store_tier._lookup = slow_read  # the disk read under get and get_many
        stream = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        _, running = engine.submit(list(range(200, 220)), stream)
        engine.step()  # the stream is running
        _, waiting = engine.submit(prefix + [40], greedy)
        decoded = 0
        started = time.monotonic()
        while time.monotonic() - started < 1.0:  # the read takes 8 x 0.3 s: the stream decodes all along
            engine.step()
            decoded += sum(len(out.token_ids) for out in _drain(running))
        assert decoded >= 20, decoded
        assert reader_threads == {"tierserve-kv-load_0"}
        while engine.has_work():
            engine.step()
        tokens = [t for out in _drain(waiting) for t in out.token_ids]
        assert tokens == cold.token_ids
        stats = engine.stats().cache
        assert stats.loads == 1 and stats.promotions["l3"] == 8 and stats.load_timeouts == 0
    finally:
        engine.close()


def test_prefix_reads_time_out_from_their_start_not_from_their_place_in_the_loader_queue(tiny, tmp_path):
    """Two prompts whose prefixes sit only on a slow disk (0.8 s a prefix) arrive together under a 1 s limit:
    the second read waits 0.8 s behind the first, then takes 0.8 s, and is used (1.6 s after it was asked for).
    Under a 0.5 s limit both reads are given up: counted as timeouts, the prompts computed, the output the same."""
    import time

    tier = {"name": "l3", "plugin": "disk", "path": str(tmp_path / "l3"), "write_through": True}
    prefixes = [list(range(3, 35)), list(range(50, 82))]  # 8 blocks each
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for limit, timeouts in ((1.0, 0), (0.5, 2)):
        engine = make_engine(tiny, kv_cache__block_size=4, kv_cache__tiers=[tier])
        try:
            cold = engine.generate([p + [40] for p in prefixes], greedy)
            store = engine.driver.core.scheduler.kv.store  # white-box: its limit, and a slow disk
            store.flush()
            engine.clear_cache("l1")
            store.load_timeout = limit
            disk = store.tiers[0].tier.inner  # the disk tier in its guard (cache.guarded_tier)
            read = disk._lookup
            disk._lookup = lambda key: time.sleep(0.1) or read(key)
            warm = engine.generate([p + [40] for p in prefixes], greedy)
            assert [r.token_ids for r in warm] == [r.token_ids for r in cold]
            stats = engine.stats().cache
            assert stats.loads == 2 and stats.load_timeouts == timeouts, (limit, stats.loads, stats.load_timeouts)
            assert stats.promotions["l3"] == (16 if timeouts == 0 else 0)
        finally:
            engine.close()
        tier["path"] = str(tmp_path / "l3-second")


def _finished_tokens(stream) -> list[int]:
    """Every token of a request that has ended (its outputs are all queued)."""
    tokens = []
    while True:
        out = stream.get(timeout=1)
        tokens += out.token_ids
        if out.finished:
            return tokens


def _drain(stream) -> list:
    import queue

    outs = []
    while True:
        try:
            outs.append(stream.get(timeout=0))
        except queue.Empty:
            return outs


def test_a_cache_flush_waits_for_the_disk_without_stopping_decodes(tiny, tmp_path):
    """``flush_cache`` (``POST /v1/cache/flush``'s call) answers once the queued disk writes are stored, and
    the core keeps stepping while it waits: a running stream gets its tokens meanwhile."""
    import time

    tier = {"name": "l3", "plugin": "disk", "path": str(tmp_path / "l3"), "write_through": True}
    engine = make_engine(tiny, kv_cache__block_size=4, kv_cache__tiers=[tier])
    engine.start()  # the core on its own thread, as the server runs it
    try:
        writer = engine.driver.core.scheduler.kv.store.tiers[0].tier._writer  # white-box: a slow disk
        write = writer._write

        def slow_write(entry):
            time.sleep(0.1)
            return write(entry)

        writer._write = slow_write
        _, running = engine.submit(list(range(200, 220)), SamplingParams(temperature=0, max_tokens=400,
                                                                         ignore_eos=True))  # fmt: skip
        engine.generate([list(range(3, 67))], SamplingParams(temperature=0, max_tokens=1))  # 16 blocks to write
        _drain(running)
        started = time.monotonic()
        engine.flush_cache()
        waited = time.monotonic() - started
        assert waited >= 0.5  # most of the 16 x 0.1 s of writes were still queued
        assert engine.driver.core.scheduler.kv.store.writes_stored()
        decoded = sum(len(out.token_ids) for out in _drain(running))
        assert decoded >= 10, decoded  # before: 0 (the step thread waited for the disk)
    finally:
        engine.close()
