"""The layout of a step's batch (``build_paged_batch``): the one-sequence decode shortcut builds what the
general path builds, and hands over to it wherever a mask is needed."""

from __future__ import annotations

import pytest
import torch

from tierserve.core.batch import ScheduledChunk
from tierserve.core.sampling_params import SamplingParams
from tierserve.core.sequence import Sequence
from tierserve.plugins.backends import paged_attention
from tierserve.plugins.backends.paged_attention import build_paged_batch, lone_decode

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


def decoding(length: int, table: list[int], dropped: tuple[int, int] = (0, 0)) -> ScheduledChunk:
    """The chunk that decodes the next token of a sequence of ``length`` tokens, ``length - 1`` computed."""
    seq = Sequence(seq_id=1, request_id="r", token_ids=list(range(3, 3 + length)), num_prompt_tokens=2,
                   params=SamplingParams(max_tokens=64), block_table=table, num_computed_tokens=length - 1)  # fmt: skip
    seq.kv_drop_start, seq.kv_drop_end = dropped
    return ScheduledChunk(seq, 1)


def general(chunk: ScheduledChunk, windows: list[int | None]) -> paged_attention.PagedBatch:
    """The batch the general path builds, the shortcut switched off."""
    shortcut = paged_attention.lone_decode
    paged_attention.lone_decode = lambda *args: None
    try:
        return build_paged_batch([chunk], 4, windows, CPU)
    finally:
        paged_attention.lone_decode = shortcut


@pytest.mark.parametrize("length", [1, 4, 5, 23])
@pytest.mark.parametrize("windows", [[None], [None, 32]], ids=["full", "window-wider-than-context"])
def test_one_sequence_decode_is_laid_out_as_the_general_path_does(length, windows):
    chunk = decoding(length, [7, 2, 9, 4, 11, 5])
    fast, slow = build_paged_batch([chunk], 4, windows, CPU), general(chunk, windows)
    for name in ("input_ids", "positions", "slot_mapping", "sample_rows"):
        assert torch.equal(getattr(fast, name), getattr(slow, name)), name
    assert fast.max_position == slow.max_position and fast.order == slow.order
    [a], [b] = fast.groups, slow.groups
    assert (a.rows, a.ctx, a.batch, a.q_len, a.shared) == (b.rows, b.ctx, b.batch, b.q_len, b.shared)
    assert torch.equal(a.blocks, b.blocks)
    assert a.masks == b.masks == dict.fromkeys(windows)


@pytest.mark.parametrize(
    ("length", "windows", "dropped"),
    [(23, [None, 8], (0, 0)), (23, [8], (0, 12))],
    ids=["window-shorter-than-context", "released-kv"],
)
def test_a_decode_that_needs_a_mask_takes_the_general_path(length, windows, dropped):
    chunk = decoding(length, [7, 2, 9, 4, 11, 5], dropped)
    assert lone_decode(chunk, 4, windows, CPU) is None
    assert any(mask is not None for mask in build_paged_batch([chunk], 4, windows, CPU).groups[0].masks.values())


def _resident_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def test_the_arena_is_committed_as_it_is_written_not_at_allocation():
    """kv_cache.l1_capacity sizes the arena, but memory is held only for the blocks written (zero until then)."""
    from tierserve.plugins.backends.paged_attention import KVArena

    arena = KVArena(4, 2, 64, torch.float32, torch.device("cpu"))
    before = _resident_bytes()
    arena.allocate(num_blocks=4096, block_size=16)  # 4 layers x 2 x 4096 x 16 x 2 x 64 x 4 bytes = 268 MiB
    reserved = sum(t.nbytes for t in arena.k + arena.v)
    assert reserved == 4 * 2 * 4096 * 16 * 2 * 64 * 4
    assert _resident_bytes() - before < reserved // 20
    assert all(float(t[::997].abs().sum()) == 0.0 for t in arena.k + arena.v)  # reads as zeros
    arena.write_blocks(torch.tensor([3]), torch.ones(1, 4, 2, 16, 2, 64))
    assert float(arena.k[0].view(-1, 16, 2, 64)[3].sum()) == 16 * 2 * 64
    assert _resident_bytes() - before < reserved // 20
