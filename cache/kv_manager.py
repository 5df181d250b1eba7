"""Per-sequence block tables on the L1 pool: allocation, prefix reuse, rollback and window release.

The scheduler owns one ``KVCacheManager`` and asks it for everything KV:

    can_admit(seq, budget)   whether a waiting sequence's admission would find its blocks (nothing touched)
    prefix_loaded(seq)       its prefix below L1 read off the step thread (started on the first call)
    match_prefix(seq)        a new or preempted sequence starts from its longest cached prefix
    allocate_slots(seq, n)   grow the table to cover positions [0, n) (lookahead slots for drafts included)
    cache_computed(seq)      publish newly completed blocks to the prefix cache
    trim(seq, n)             give back blocks past position n (rejected drafts)
    release_out_of_window(seq)   free blocks no future token attends to (sliding windows)
    free(seq) / reset(seq)   finished, aborted or preempted

Released blocks leave a placeholder in the table (``PLACEHOLDER_BLOCK``) so
positions keep their indices; the chunk tells the backend which key
positions were released (``ScheduledChunk.released``), and no backend ever
reads a placeholder's content unmasked.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierserve.cache.block_pool import BlockPool
from tierserve.cache.lookup_info import RequestCacheInfo

READ_HERE = "read at the match"  # seq.kv_load of a prompt with nothing to read off host memory

if TYPE_CHECKING:
    from tierserve.cache.stats import PrefixMatch
    from tierserve.cache.store import PrefixLoad
    from tierserve.cache.store import TieredStore
    from tierserve.core.sections import SlidingWindowSettings
    from tierserve.core.sequence import Sequence

PLACEHOLDER_BLOCK = 0  # what a released entry of a block table points at; never written through it


@dataclass(frozen=True, slots=True)
class KVSpec:
    """What the KV manager must know of a model's KV layout (``ModelBackend.kv_spec``).

    Attributes:
        block_bytes: bytes one block of ``block_size`` tokens takes across all layers.
        sliding_window: set when EVERY layer attends only to the last
            ``sliding_window`` positions (a trained window, e.g. Mistral's), so
            older KV is never read again and its blocks can be released.
    """

    block_bytes: int
    sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class StreamingWindow:
    """Opt-in long-sequence mode: keep ``sink_tokens`` plus the last ``window_size`` tokens;
    release in steps once ``window_overlap`` tokens past the window have piled up."""

    sink_tokens: int
    window_size: int
    window_overlap: int

    @classmethod
    def of(cls, window: SlidingWindowSettings) -> StreamingWindow:
        """The window ``[sliding_window]`` describes."""
        return cls(window.sink_tokens, window.window_size, window.window_overlap)

    def sized(self, window_size: int | None) -> StreamingWindow:
        """This window with a request's own ``window_size`` (None: unchanged); the overlap stays below
        half of it, so a small window still releases blocks as it slides."""
        if window_size is None or window_size == self.window_size:
            return self
        return StreamingWindow(self.sink_tokens, window_size, min(self.window_overlap, window_size // 2))


@dataclass(slots=True)
class WindowStats:
    """Sliding-window counters: slides, tokens whose KV was dropped, blocks released, and how
    often windowed sequences found their KV in the cache (block hits and misses of their lookups)."""

    windows_slid: int = 0
    tokens_dropped: int = 0
    blocks_released: int = 0
    cache_hits: int = 0
    cache_misses: int = 0


@dataclass(slots=True)
class SharingStats:
    """Prefix sharing in L1: lookups that reused a block another running sequence was using at that moment."""

    sharing_hits: int = 0


class KVCacheManager:
    """Block tables on top of a ``BlockPool``, with prefix reuse when a store is attached.

    Args:
        pool: the L1 block pool.
        store: the tiered prefix store, or ``None`` (no prefix caching).
        spec: the model's KV layout (a trained sliding window releases blocks).
        streaming: the settings of streaming mode, for sequences that use it.
    """

    def __init__(
        self,
        pool: BlockPool,
        store: TieredStore | None = None,
        spec: KVSpec | None = None,
        streaming: StreamingWindow | None = None,
    ) -> None:
        self.pool = pool
        self.store = store
        self.spec = spec or KVSpec(block_bytes=0)
        self.streaming = streaming
        self.block_size = pool.block_size
        self.window_stats = WindowStats()
        self.sharing = SharingStats()
        self._loads: list[tuple[Sequence, PrefixLoad]] = []  # prefix reads started for waiting prompts

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole pool holds."""
        return self.pool.num_blocks * self.block_size

    def blocks_needed(self, num_tokens: int, num_held: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - num_held)

    def allocate_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow ``seq.block_table`` to cover positions ``[0, num_tokens)``; False (and no change) if the pool is short."""
        needed = self.blocks_needed(num_tokens, len(seq.block_table))
        if needed > self.pool.num_free_blocks:
            return False
        if needed:
            seq.block_table.extend(self.pool.allocate(needed))
        return True

    def can_admit(self, seq: Sequence, budget: int) -> bool:
        """Whether admitting ``seq`` now (its L1 prefix shared, then up to ``budget`` tokens computed) finds the
        free blocks it needs, judged without a side effect: a prompt that waits for memory is not looked up
        (no statistics, no policy touched, no tier read) until it can run. A prompt whose cached prefix lies
        below L1 may still fall short once matched (more of it is cached, so its chunk reaches further); its
        shortfall is remembered (``seq.blocks_wanted``) so it is not matched again before that many are free."""
        if seq.block_table or seq.num_computed_tokens:
            return True
        free = self.pool.num_free_blocks
        if free < seq.blocks_wanted:
            return False
        shared = revived = 0
        if self.store is not None and seq.reads_prefix_cache:
            shared, revived = self.store.l1_prefix(seq)
        cached = shared * self.block_size
        total = self.blocks_needed(cached + min(seq.num_tokens - cached, budget), 0)
        return total - shared <= free - revived

    def prefix_loaded(self, seq: Sequence) -> bool:
        """Whether ``seq`` can be matched now. The first call starts reading, on the store's loader thread, the
        blocks of its prompt that sit below L1 (``TieredStore.start_load``); until they are read (or the read
        fails or runs late) it waits and the scheduler admits others. Nothing to read off host memory: at once
        (the match reads a memory tier itself)."""
        if self.store is None or seq.block_table or seq.num_computed_tokens or not seq.reads_prefix_cache:
            return True
        if seq.kv_load is None:
            load = self.store.start_load(seq)
            seq.kv_load = READ_HERE if load is None else load
            if load is not None:
                if len(self._loads) >= 64:
                    self._forget_loads()
                self._loads.append((seq, load))
        return seq.kv_load is READ_HERE or seq.kv_load.settled

    def wait_for_loads(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) for the first unsettled prefix read: a step with nothing to run
        but prompts whose prefixes are being read sleeps here instead of spinning."""
        self._forget_loads()
        pending = [load.future for _, load in self._loads if not load.settled]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def _forget_loads(self) -> None:
        """Drop the prefix reads whose prompt was matched, aborted or finished since they started."""
        self._loads = [(seq, load) for seq, load in self._loads if seq.kv_load is load and not seq.is_finished]

    def missed_admission(self, seq: Sequence, num_tokens: int) -> None:
        """A matched sequence that could not get its blocks: give them back (they stay cached) and remember how
        many free blocks it needs before it is matched again."""
        short, before = self.blocks_needed(num_tokens, len(seq.block_table)), self.pool.num_free_blocks
        self.reset(seq)
        # its matched blocks just became free: the next match takes them again, so count them on top
        seq.blocks_wanted = short + self.pool.num_free_blocks - before

    def match_prefix(self, seq: Sequence) -> PrefixMatch | None:
        """Start a sequence that holds no blocks from its longest cached prefix, and record the
        accounting on it (``seq.cache_info``). Returns what the store found, or ``None`` when
        nothing was looked up (no store, caching off for the request, its prompt needs logits for its
        logprobs, or blocks already held)."""
        if seq.block_table or seq.num_computed_tokens:
            return None
        match = None
        if self.store is not None and seq.reads_prefix_cache:  # a prompt scored for its logprobs is recomputed
            load, seq.kv_load = seq.kv_load, None  # a later admission (after preemption) reads again
            # not read in the background (a memory tier, or not through the scheduler: a warm): the store asks
            # the tiers itself
            loaded = None if load is None or load is READ_HERE else load.entries(self.store.stats)
            match = self.store.match_prefix(seq, loaded)
            info = RequestCacheInfo(match.lookup_blocks, dict(match.hits), seq.num_cached_tokens, match.seconds)
            blocks = self.pool.blocks  # a promoted block is new (one holder); an L1 hit may have others
            self.sharing.sharing_hits += sum(1 for b in seq.block_table if blocks[b].ref_count > 1)
        else:
            usable = (seq.num_tokens - 1) // self.block_size  # never the last token: its logits are needed
            info = RequestCacheInfo(lookup_blocks=usable)
        if self.windowed(seq):
            info.windowed = True
            self.window_stats.cache_hits += info.hit_blocks
            self.window_stats.cache_misses += info.lookup_blocks - info.hit_blocks
        seq.cache_info = info
        seq.cache_info_pending = True
        return match

    def windowed(self, seq: Sequence) -> bool:
        """Whether a sliding window bounds this sequence's KV (a trained window, or streaming mode)."""
        return self.spec.sliding_window is not None or (seq.streaming and self.streaming is not None)

    def window_blocks(self, seq: Sequence) -> int:
        """The most blocks a windowed sequence keeps: its window (sinks and overlap included) plus the block being filled."""
        if self.spec.sliding_window is not None:
            tokens = self.spec.sliding_window
        else:
            window = self.streaming.sized(seq.window_size)
            tokens = window.sink_tokens + window.window_size + window.window_overlap
        return -(-tokens // self.block_size) + 1

    def held_blocks(self, seq: Sequence) -> int:
        """Blocks a sequence holds now (released ones excluded)."""
        first, end = seq.released_blocks
        return len(seq.block_table) - (end - first)

    def cache_computed(self, seq: Sequence) -> None:
        """Publish the sequence's newly completed blocks to the prefix cache."""
        if self.store is not None:
            self.store.register_computed(seq)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free trailing blocks that ``num_tokens`` tokens no longer need (rejected drafts)."""
        keep = -(-num_tokens // self.block_size)
        table = seq.block_table
        if len(table) > keep:
            self.pool.free(list(reversed(table[keep:])))
            del table[keep:]

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks, tail first so shared prefix blocks stay cached longest."""
        first, end = seq.released_blocks
        held = [block for index, block in enumerate(seq.block_table) if not first <= index < end]
        self.pool.free(held[::-1])
        seq.block_table.clear()
        seq.released_blocks = (0, 0)

    def reset(self, seq: Sequence) -> None:
        """Free a sequence's blocks and forget its progress (preemption, or a failed admission)."""
        self.free(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = seq.num_registered_blocks = 0

    def release_out_of_window(self, seq: Sequence) -> None:
        """Free the blocks no future token of ``seq`` will attend to (a trained window, or streaming mode)."""
        bs = self.block_size
        if self.spec.sliding_window is not None:
            start, end = 0, max(0, (seq.num_computed_tokens - self.spec.sliding_window) // bs) * bs
        elif seq.streaming and self.streaming is not None:
            window = self.streaming.sized(seq.window_size)
            start = -(-window.sink_tokens // bs) * bs  # sinks are kept in whole blocks
            kept_from = max(seq.kv_drop_end, start)
            if seq.num_computed_tokens - kept_from <= window.window_size + window.window_overlap:
                return
            end = max(start, (seq.num_computed_tokens - window.window_size) // bs * bs)
        else:
            return
        if end <= seq.kv_drop_end or end <= start:
            return
        first = max(start, seq.kv_drop_end) // bs
        released = self._release(seq, first, end // bs)
        stats = self.window_stats
        stats.windows_slid += 1
        stats.tokens_dropped += end - max(start, seq.kv_drop_end)
        stats.blocks_released += released
        seq.windows_slid += 1
        seq.kv_drop_start, seq.kv_drop_end = start, end

    def _release(self, seq: Sequence, first: int, last: int) -> int:
        """Free table entries ``first..last-1`` (placeholders afterwards); returns how many were held."""
        table = seq.block_table
        done_first, done_end = seq.released_blocks
        held = [table[i] for i in range(first, last) if not done_first <= i < done_end]
        self.pool.free(held)
        table[first:last] = [PLACEHOLDER_BLOCK] * (last - first)
        if done_end == done_first:
            seq.released_blocks = (first, last)
        else:
            seq.released_blocks = (min(done_first, first), max(done_end, last))
        return len(held)
