"""Sliding windows: a trained window frees old blocks exactly; streaming mode runs far past the KV budget."""

from __future__ import annotations

import pytest

from tests.engine_helpers import PROMPTS, build_checkpoint, hf_greedy, make_engine
from tierserve.core.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


def test_trained_window_releases_blocks_and_matches_transformers(tmp_path):
    path = build_checkpoint(tmp_path, "mistral", "mistral", sliding_window=8)
    expected = hf_greedy(path, PROMPTS[:4], 48)
    engine = make_engine(path, kv_cache__block_size=4)
    results = engine.generate(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    assert [r.token_ids for r in results] == expected
    window = engine.stats().sliding_window
    assert window.blocks_released > 0 and window.tokens_dropped > 0
    engine.check_integrity()
    assert engine.stats().sliding_window.blocks_in_use == 0
    engine.close()


def test_streaming_mode_generates_four_times_its_kv_budget_in_flat_memory(tmp_path):
    path = build_checkpoint(tmp_path, "llama", "llama", max_position_embeddings=192)
    budget_blocks = 16  # 64 tokens of KV
    engine = make_engine(
        path,
        kv_cache__block_size=4,
        kv_cache__l1_capacity=budget_blocks,
        kv_cache__l2_capacity=0,
        sliding_window__enabled=True,
        sliding_window__window_size=32,
        sliding_window__window_overlap=8,
        sliding_window__sink_tokens=4,
    )
    new_tokens = 4 * budget_blocks * 4  # four times the KV budget, and past the 192 trained positions
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    _, stream = engine.submit(engine.encode_prompt(PROMPTS[1]), params)
    peak, tokens = 0, []
    while True:
        engine.step()
        peak = max(peak, engine.stats().sliding_window.blocks_in_use)
        try:
            while True:
                out = stream.get(timeout=0)
                tokens += out.token_ids
                if out.finished:
                    break
        except Exception:
            continue
        break
    assert len(tokens) == new_tokens and out.finish_reason == "length"
    # sinks + window + overlap + the blocks being filled: flat, far below what the output needs
    assert peak <= (4 + 32 + 8) // 4 + 3
    window = engine.stats().sliding_window
    assert window.windows_slid > 5 and window.tokens_dropped > new_tokens // 2
    engine.check_integrity()
    assert engine.stats().sliding_window.blocks_in_use == 0
    engine.close()


def test_window_off_by_default_and_budget_still_enforced(tmp_path):
    path = build_checkpoint(tmp_path, "llama", "llama")
    engine = make_engine(path, kv_cache__block_size=4, kv_cache__l1_capacity=24)
    import pytest

    from tierserve.engine import RequestError

    with pytest.raises(RequestError, match="KV cache capacity"):
        engine.submit(engine.encode_prompt("hi"), SamplingParams(max_tokens=200))
    engine.close()
