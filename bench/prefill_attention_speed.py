"""tierserve's prefill attention kernel against the torch path it replaces, on the bench model's heads.

    python -m bench.prefill_attention_speed
    python -m bench.prefill_attention_speed --repeats 40

Four cases of one layer (12 query heads on 4 KV heads of 64, float32 KV in
blocks of 16 scattered over an arena): a chat turn's chunk (64 new tokens
over 2432 positions, causal), a cold causal prefill of 512 and of 2048
tokens, and a decode batch's shared prefix (8 sequences' queries over 2048
common positions, with each row's log-sum-exp). A fifth is a whole decode
group of 8 sequences on that prefix with 300-510 positions of their own
(``KVArena.attend``): both parts through the kernel in place against the own
part gathered and run by torch's ``attention_with_lse`` (the prefix through
the kernel either way), merged by log-sum-exp. The torch side is what
``KVArena.attend`` ran before the kernel: the keys and values gathered out
of the arena by slot, then ``scaled_dot_product_attention`` (causal, or with the
boolean mask of a chunk after cached positions; for the shared prefix its
``attention_with_lse``). The two alternate call by call;
their outputs must agree to float32 rounding. Prints median milliseconds.
Not part of the tests: the README's prefill attention figures came from it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tierserve.plugins.backends import cpu_gemm
from tierserve.plugins.backends.paged_attention import (
    AttentionGroup,
    KVArena,
    additive_mask,
    attention,
    attention_with_lse,
    merge_attention,
    shared_prefix,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 12, 4, 64, 16
CASES = [("chat turn: 64 new over 2432", 64, 2432, True), ("cold prefill 512", 512, 512, True),
         ("cold prefill 2048", 2048, 2048, True), ("shared prefix: 8 rows over 2048", 8, 2048, False)]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    lib = cpu_gemm.library()
    if lib is None or not lib.has_prefill_attention:
        raise SystemExit("the prefill attention kernel runs on cpu_gemm's AVX-512 build only")
    generator = torch.Generator().manual_seed(0)
    num_blocks = 4096 // BLOCK * 2
    k_cache = torch.randn(num_blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=generator)
    v_cache = torch.randn(num_blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=generator)
    scale = HEAD_DIM**-0.5
    print(f"{'case':<34} {'kernel ms':>10} {'torch ms':>10} {'speed-up':>9}")
    for name, queries, ctx, causal in CASES:
        table = torch.randperm(num_blocks, generator=generator)[: -(-ctx // BLOCK)]
        slots = (table[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)[:ctx]
        q = torch.randn(queries, HEADS, HEAD_DIM, generator=generator)
        bottom_right = torch.ones(queries, ctx, dtype=torch.bool).tril(ctx - queries)

        def kernel() -> torch.Tensor:
            found = cpu_gemm.prefill_attention(q, k_cache, v_cache, table[None], BLOCK, ctx, None, scale,
                                               causal=causal, with_lse=not causal)  # fmt: skip
            return found if causal else found[0]

        def gathered() -> torch.Tensor:
            keys = k_cache.index_select(0, slots).transpose(0, 1)[None]  # [1, kv_heads, ctx, d]
            values = v_cache.index_select(0, slots).transpose(0, 1)[None]
            if causal:  # torch's is_causal aligns the queries top-left: a chunk after cached positions needs a mask
                mask = None if queries == ctx else bottom_right
                return attention(q.transpose(0, 1)[None], keys, values, mask, mask is None, scale)[0].transpose(0, 1)
            # the engine's shared prefix: every sequence's query heads as the rows of one KV head's queries
            rows = q.view(queries, KV_HEADS, -1, HEAD_DIM).transpose(0, 1).reshape(1, KV_HEADS, -1, HEAD_DIM)
            out, _ = attention_with_lse(rows, keys, values, None, scale)
            return out.view(KV_HEADS, queries, -1, HEAD_DIM).transpose(0, 1).reshape(queries, HEADS, HEAD_DIM)

        times: dict[str, list[float]] = {"kernel": [], "torch": []}
        for _ in range(args.repeats):
            for label, run in (("kernel", kernel), ("torch", gathered)):
                start = time.perf_counter()
                run()
                times[label].append(time.perf_counter() - start)
        if not torch.allclose(kernel(), gathered(), atol=1e-4, rtol=1e-4):
            raise SystemExit(f"{name}: the kernel and torch disagree")
        report(name, times)
    decode_group(args.repeats, generator, scale)


def report(name: str, times: dict[str, list[float]]) -> None:
    own, peer = (statistics.median(times[label]) * 1e3 for label in ("kernel", "torch"))
    print(f"{name:<34} {own:>10.2f} {peer:>10.2f} {peer / own:>8.2f}x")


def decode_group(repeats: int, generator: torch.Generator, scale: float) -> None:
    """8 decodes on a 2048-token shared prefix with 300-510 positions each of their own, through ``KVArena``."""
    batch, prefix_blocks, own_tokens = 8, 2048 // BLOCK, [300 + 30 * i for i in range(8)]
    own_blocks = -(-max(own_tokens) // BLOCK)
    arena = KVArena(1, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))
    arena.allocate(prefix_blocks + batch * own_blocks, BLOCK)
    for cache in (arena.k[0], arena.v[0]):
        cache.copy_(torch.randn(cache.shape, generator=generator))
    spare = torch.randperm(batch * own_blocks, generator=generator) + prefix_blocks
    tables = torch.cat([torch.arange(prefix_blocks).expand(batch, -1), spare.view(batch, own_blocks)], 1)
    lengths = torch.tensor([2048 + n for n in own_tokens])
    pos = torch.arange(int(lengths.max()))
    keep = pos[None, None, :] <= (lengths - 1)[:, None, None]
    group = AttentionGroup(slice(0, batch), tables, int(lengths.max()), {None: keep[:, None]}, batch, 1)
    group.shared = shared_prefix(tables, int(lengths.min()), {None: keep}, BLOCK, torch.device("cpu"))
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=generator)
    k_cache, v_cache = arena.k[0], arena.v[0]

    def kernel() -> torch.Tensor:
        return arena.attend(0, q, [group], None, scale)

    def gathered() -> torch.Tensor:
        ids = tables[:, prefix_blocks:].reshape(-1)
        shape = (batch, -1, KV_HEADS, HEAD_DIM)
        by_block = (-1, BLOCK, KV_HEADS, HEAD_DIM)
        own_ctx = max(own_tokens)
        keys = k_cache.view(by_block).index_select(0, ids).view(shape)[:, :own_ctx].transpose(1, 2)
        values = v_cache.view(by_block).index_select(0, ids).view(shape)[:, :own_ctx].transpose(1, 2)
        queries = q.view(batch, KV_HEADS, -1, HEAD_DIM)
        own_mask = additive_mask(group.shared.own_keeps[None], q.dtype, q.device)
        own, own_lse = attention_with_lse(queries, keys, values, own_mask, scale)
        common, common_lse = cpu_gemm.prefill_attention(q, k_cache, v_cache, torch.arange(prefix_blocks)[None],
                                                        BLOCK, 2048, None, scale, causal=False, with_lse=True)  # fmt: skip
        merged = merge_attention(own, own_lse, common.view(own.shape), common_lse.view(*own.shape[:-1], 1))
        return merged.reshape(batch, HEADS, HEAD_DIM)

    times: dict[str, list[float]] = {"kernel": [], "torch": []}
    for _ in range(repeats):
        for label, run in (("kernel", kernel), ("torch", gathered)):
            start = time.perf_counter()
            run()
            times[label].append(time.perf_counter() - start)
    if not torch.allclose(kernel(), gathered(), atol=1e-4, rtol=1e-4):
        raise SystemExit("decode group: in place and gathered disagree")
    report("decode group: 8 on 2048 + 300-510", times)


if __name__ == "__main__":
    main()
