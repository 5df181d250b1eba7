"""Decode batches read a prefix their sequences share once; the tokens are those of one request at a time."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from tests.engine_helpers import assert_pool_released, build_checkpoint, hf_greedy, make_engine
from tierserve.core.sampling_params import SamplingParams
from tierserve.plugins.backends.llama import PagedLlama
from tierserve.plugins.backends.native import load_safetensors
from tierserve.plugins.backends.paged_attention import (
    SHARED_PREFIX_MIN_TOKENS,
    AttentionGroup,
    attention_with_lse,
    attention_with_lse_math,
    shared_prefix,
)

pytestmark = pytest.mark.unit

SYSTEM = (
    "You are a careful assistant. Answer in one short sentence, cite nothing, and never repeat the question. "
    "If a question is ambiguous, pick the most common reading and say which one you picked. "
) * 2
QUESTIONS = ["What is 2 + 2?", "Name a colour.", "Why is the sky blue?", "Say hello in French, please."]
CHECKPOINTS = {
    "llama": ("llama", {}),
    "qwen3-qk-norm": ("qwen3", {}),
    "mistral-sliding-window": ("mistral", {"sliding_window": 48}),  # the window cuts into the shared prefix
}


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_requests_sharing_a_long_prefix_decode_together_as_they_would_alone(tmp_path, name):
    architecture, overrides = CHECKPOINTS[name]
    path = build_checkpoint(tmp_path, name, architecture, **overrides)
    prompts = [SYSTEM + q for q in QUESTIONS]
    expected = hf_greedy(path, prompts, 24)
    engine = make_engine(path)
    engine.generate([SYSTEM], SamplingParams(temperature=0, max_tokens=1))  # the prefix is cached: all four share it
    results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [r.token_ids for r in results] == expected
    assert all(r.cached_tokens >= SHARED_PREFIX_MIN_TOKENS for r in results)
    assert_pool_released(engine)


def _decode_group(model: PagedLlama, tables: torch.Tensor, lengths: list[int], window: int | None):
    """A decode group as the native backend builds it, and the boolean visibility it derives from."""
    block = model.arena.block_size
    ctx = torch.tensor(lengths)
    pos = torch.arange(int(ctx.max()))
    q_pos = (ctx - 1)[:, None]
    keep = pos[None, None, :] <= q_pos[:, :, None]
    if window is not None:
        keep &= pos[None, None, :] > q_pos[:, :, None] - window
    masks = {window: None if bool(keep.all()) else keep[:, None]}
    blocks = tables[:, : -(-int(ctx.max()) // block)]
    group = AttentionGroup(slice(0, len(lengths)), blocks, int(ctx.max()), masks, len(lengths), 1)
    return group, {window: keep}


@pytest.mark.parametrize(
    "kv_dtype, consecutive, window",
    [(torch.float32, True, None), (torch.float32, False, None), (torch.bfloat16, False, None), (torch.float32, True, 200)],
    ids=["consecutive", "scattered", "bf16-kv", "window-beyond-prefix"],
)
def test_shared_prefix_attention_equals_reading_every_row_whole(tmp_path, kv_dtype, consecutive, window):
    path = build_checkpoint(tmp_path, "llama", "llama")
    model = PagedLlama(AutoConfig.from_pretrained(path), load_safetensors(path), torch.device("cpu"), torch.float32,
                       kv_dtype=kv_dtype)  # fmt: skip
    block, shared_blocks, own_blocks, batch = 16, 6, 3, 5
    model.allocate_kv_cache(shared_blocks + batch * own_blocks + 4, block)
    generator = torch.Generator().manual_seed(0)
    for cache in (*model.arena.k, *model.arena.v):
        cache.copy_(torch.randn(cache.shape, generator=generator))
    prefix = torch.arange(shared_blocks) if consecutive else torch.randperm(shared_blocks, generator=generator) * 3 + 1
    used = set(prefix.tolist())
    spare = [b for b in range(len(model.arena.k[0]) // block) if b not in used]
    tables = torch.stack(
        [torch.cat([prefix, torch.tensor(spare[i * own_blocks : (i + 1) * own_blocks])]) for i in range(batch)]
    )
    lengths = [shared_blocks * block + 1 + 7 * i for i in range(batch)]  # unequal: the own part is masked
    group, keeps = _decode_group(model, tables, lengths, window)
    group.shared = shared_prefix(tables, min(lengths), keeps, block, torch.device("cpu"))
    assert group.shared is not None and group.shared.tokens == shared_blocks * block
    assert isinstance(group.shared.keys, slice) == consecutive
    q = torch.randn(batch, model.num_heads, model.head_dim, generator=generator)
    with torch.inference_mode():
        cascaded = model.arena.attend(0, q, [group], window, model.scaling)
        model.arena.own_kernels = False  # torch's portable path, as on a GPU
        portable = model.arena.attend(0, q, [group], window, model.scaling)
        group.shared = None
        whole = model.arena.attend(0, q, [group], window, model.scaling)
    torch.testing.assert_close(cascaded, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(portable, whole, rtol=1e-5, atol=1e-5)


def test_shared_prefix_attention_of_a_bfloat16_model_is_its_whole_rows_to_bfloat16_rounding(tmp_path):
    """A bfloat16 model's shared-prefix decode runs the prefill kernel's bfloat16 form (queries by keys in
    bfloat16, the softmax weights rounded to bfloat16 for the values) where reading every row whole runs the
    decode kernel's float32 weights: the two agree to bfloat16's rounding of the output."""
    path = build_checkpoint(tmp_path, "llama", "llama")
    model = PagedLlama(AutoConfig.from_pretrained(path), load_safetensors(path), torch.device("cpu"), torch.bfloat16)
    block, shared_blocks, own_blocks, batch = 16, 6, 3, 5
    model.allocate_kv_cache(shared_blocks + batch * own_blocks + 4, block)
    generator = torch.Generator().manual_seed(1)
    for cache in (*model.arena.k, *model.arena.v):
        cache.copy_(torch.randn(cache.shape, generator=generator))
    prefix = torch.randperm(shared_blocks, generator=generator) * 3 + 1
    spare = [b for b in range(len(model.arena.k[0]) // block) if b not in set(prefix.tolist())]
    tables = torch.stack(
        [torch.cat([prefix, torch.tensor(spare[i * own_blocks : (i + 1) * own_blocks])]) for i in range(batch)]
    )
    lengths = [shared_blocks * block + 1 + 7 * i for i in range(batch)]
    group, keeps = _decode_group(model, tables, lengths, None)
    group.shared = shared_prefix(tables, min(lengths), keeps, block, torch.device("cpu"))
    q = torch.randn(batch, model.num_heads, model.head_dim, generator=generator).to(torch.bfloat16)
    with torch.inference_mode():
        cascaded = model.arena.attend(0, q, [group], None, model.scaling)
        group.shared = None
        whole = model.arena.attend(0, q, [group], None, model.scaling)
    assert cascaded.dtype == whole.dtype == torch.bfloat16
    torch.testing.assert_close(cascaded.float(), whole.float(), rtol=2e-2, atol=1e-2)
    assert float((cascaded.float() - whole.float()).abs().mean()) < 2e-3


def test_no_shared_part_where_a_window_hides_it_or_it_is_short():
    tables = torch.stack([torch.arange(10), torch.cat([torch.arange(8), torch.tensor([20, 21])])])
    lengths = torch.tensor([150, 150])
    pos = torch.arange(150)
    keep = (pos[None, None, :] <= (lengths - 1)[:, None, None])
    assert shared_prefix(tables, 150, {None: keep}, 16, torch.device("cpu")).tokens == 128
    windowed = keep & (pos[None, None, :] > (lengths - 1)[:, None, None] - 100)
    assert shared_prefix(tables, 150, {100: windowed}, 16, torch.device("cpu")) is None
    assert shared_prefix(tables[:, :3].contiguous(), 40, {None: keep[:, :, :40]}, 16, torch.device("cpu")) is None
    assert shared_prefix(tables[:1], 150, {None: keep[:1]}, 16, torch.device("cpu")) is None


def test_the_portable_log_sum_exp_attention_matches_the_cpu_kernel():
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, 2, n, 16, generator=generator) for n in (4, 40, 40))
    mask = torch.zeros(3, 1, 1, 40).masked_fill_(torch.rand(3, 1, 1, 40, generator=generator) < 0.3, float("-inf"))
    mask[..., 0] = 0.0
    kernel, kernel_lse = attention_with_lse(q, k, v, mask, 0.25)
    portable, portable_lse = attention_with_lse_math(q, k, v, mask, 0.25)
    torch.testing.assert_close(kernel, portable, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kernel_lse, portable_lse, rtol=1e-5, atol=1e-5)
