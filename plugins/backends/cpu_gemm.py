"""tierserve's own CPU matmul kernels (``cpu_gemm.c``): weights packed per tile of 4 output rows, streamed once.

PyTorch has no fast CPU path for two cases decode hits on AVX2 machines:
bfloat16 weights without AVX512-BF16 (``F.linear`` widens the whole weight on
every call; oneDNN refuses to prepack it) and int8 weights at batch 1-4
(fbgemm's dynamic-quantized linear spends most of a small call outside the
dot products). The C kernels read each weight once per call in a layout made
for them and convert it in registers; llama.cpp's CPU backend works the same
way. See ``cpu_gemm.c`` for the layouts and the arithmetic; ``fused_decode.py``
runs a whole decode step's layers through its ``ts_decode_layers``.

The kernels are compiled when the package is built (``setup.py``; ``pip
install -e .`` in a checkout), one shared object per instruction set
(``cpu_gemm_builds.py``: AVX2 + FMA, and AVX-512 F/BW/VL/VNNI/BF16), and
loaded here with ctypes through ``cpu_gemm_abi.py``, which checks the object's
version and struct layouts at load and every tensor at each call; nothing is
compiled at run time. Their OpenMP calls share the thread pool torch's bundled
``libgomp`` already runs. Without an x86 CPU with AVX2 and FMA, or where the
install could not build them (no C compiler then), ``library()`` is None and
callers keep torch's kernels (logged; ``unavailable_reason()`` says why).

``TIERSERVE_CPU_GEMM_ISA`` (``auto``, ``avx2``, ``avx512``) picks the build:
``auto`` is ``avx512`` where ``/proc/cpuinfo`` lists every flag it needs and
that build was made, else ``avx2``. The AVX-512 build's q8 results are the
AVX2 build's to the bit (vpdpbusd sums the same int32 lanes); its bfloat16
products run vdpbf16ps (``bf16_dot()``), in their own summation order. The
cache fingerprint names the build and ``KERNEL_VERSION`` (never the source).
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from pathlib import Path

import torch

from tierserve.plugins.backends.cpu_gemm_abi import (
    BF16, F32, MAX_GROUP, PANEL, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q6_SUPER, Q8_GROUPED, Q8_ROW, QK, TILE, KernelLoadError, Kernels, Projection,
)
from tierserve.plugins.backends.cpu_gemm_builds import CPU_FLAGS, ISAS, KERNEL_VERSION, SOURCES, cpu_flags, object_name

log = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).parent  # where setup.py puts the builds (in place for an editable install)
ISA_VARIABLE = "TIERSERVE_CPU_GEMM_ISA"
MAX_HEADS_PER_KV_HEAD = MAX_GROUP

_unavailable: list[str] = []


def unavailable_reason() -> str | None:
    """Why ``library()`` is None, or None when it loaded."""
    return None if library() is not None else _unavailable[0]


@functools.cache
def library() -> Kernels | None:
    """This CPU's build of the kernels, loaded on first call; None where they cannot run (logged once)."""
    try:
        kernels = _load()
    except (OSError, RuntimeError, ValueError) as exc:
        _unavailable.append(str(exc))
        log.warning("cpu_gemm_unavailable reason=%s; torch's kernels run instead", exc)
        return None
    log.info("cpu_gemm_loaded isa=%s version=%d path=%s", kernels.isa, KERNEL_VERSION, kernels.path)
    return kernels


def fingerprint_tag(device: torch.device, dtype: torch.dtype | None = None, kv_dtype: torch.dtype | None = None) -> str:
    """What the cache fingerprint adds where these kernels compute (their build and ``KERNEL_VERSION``): KV
    computed with them is never served to a process computing without them, or with other results. bfloat16
    KV under float32 weights on the AVX-512 build: prompt attention rounds its queries (``prefill_attention``'s
    ``round_queries``), so later layers' KV differs from a float32-query build's, and that is named too."""
    if device.type != "cpu" or library() is None:
        return ""
    tag = f"/cpu-gemm-{isa()}-v{KERNEL_VERSION}"
    if isa() == "avx512" and kv_dtype == torch.bfloat16 and dtype == torch.float32:
        tag += "/bf16-prompt-attention"
    return tag


@functools.cache
def isa() -> str:
    """The build that runs: ``$TIERSERVE_CPU_GEMM_ISA``, or (``auto``) ``avx512`` where the CPU has AVX-512
    F/BW/VL/VNNI/BF16 and that build was made, else ``avx2``."""
    asked = _asked_isa()
    if asked not in ("auto", *ISAS):
        raise ValueError(f"{ISA_VARIABLE}: got {asked!r}, allowed: auto, {', '.join(ISAS)}")
    missing = sorted(set(CPU_FLAGS["avx512"]) - cpu_flags())
    if asked == "avx512" and missing:  # the build would die of SIGILL at its first call
        raise ValueError(f"{ISA_VARIABLE}=avx512: this CPU lacks {', '.join(missing)}; allowed here: auto, avx2")
    if asked != "auto":
        return asked
    if missing:
        return "avx2"
    if not (KERNEL_DIR / object_name("avx512")).exists():
        log.warning("cpu_gemm_avx512_not_built dir=%s; the avx2 build runs (the compiler at install time lacked "
                    "-mavx512bf16: gcc 10 or later builds it)", KERNEL_DIR)  # fmt: skip
        return "avx2"
    return "avx512"


def _asked_isa() -> str:
    return os.environ.get(ISA_VARIABLE, "auto").strip().lower() or "auto"


def bf16_dot() -> bool:
    """Whether bfloat16 weights multiply with vdpbf16ps (the AVX-512 build): activations rounded to bfloat16."""
    lib = library()
    return lib is not None and lib.avx512


def float_panels() -> bool:
    """Whether ``auto`` runs float32 weights on tierserve's panel kernel (the AVX-512 build): 1.2x oneDNN's
    float32 GEMM at 32 rows here and even with it at prefill sizes; on AVX2 machines oneDNN keeps them."""
    return bf16_dot()


def _load() -> Kernels:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"the kernels need an x86-64 CPU, this is {platform.machine()}")
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        raise RuntimeError(f"the kernels need AVX2 and FMA; torch reports {torch.backends.cpu.get_cpu_capability()}")
    chosen = isa()
    path = KERNEL_DIR / object_name(chosen)
    if not path.exists():
        raise RuntimeError(
            f"the {chosen} kernels were not built ({path} is missing): tierserve was installed without a C compiler "
            "that builds them; install gcc and reinstall tierserve (in a checkout: pip install -e .)"
        )
    checkout = (KERNEL_DIR.parents[1] / "setup.py").exists()  # an editable install: the objects sit beside the source
    for name in SOURCES if checkout else ():
        source = KERNEL_DIR / name
        if source.exists() and source.stat().st_mtime > path.stat().st_mtime:
            log.warning("cpu_gemm_stale path=%s; %s changed after it was built: rebuild with pip install -e .",
                        path, name)  # fmt: skip
    try:
        return Kernels(path, chosen)
    except KernelLoadError as exc:
        raise RuntimeError(str(exc)) from exc


def _pad_rows(weight: torch.Tensor, multiple: int = TILE) -> torch.Tensor:
    extra = -weight.shape[0] % multiple
    return torch.cat([weight, weight.new_zeros(extra, *weight.shape[1:])]) if extra else weight


class PackedFloat:
    """A float weight packed for tierserve's kernels; calls take and return float32 rows. bfloat16: the
    ``[N/4][K/8][4][8]`` layout. float32: panels of ``PANEL`` output columns, ``[N/32][K][32]`` (the last
    zero-padded), each output element one multiply-add chain over K in order (``cpu_gemm.c``)."""

    __slots__ = ("weight", "bias", "out_features", "in_features", "panels_bf16", "checked")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        if library() is None:
            raise ValueError(f"PackedFloat: tierserve's CPU kernels are unavailable: {unavailable_reason()}")
        if not supports_float(weight):
            raise ValueError(f"PackedFloat cannot hold a {weight.device.type} {weight.dtype} {list(weight.shape)} "
                             "weight (CPU float32 or bfloat16, width a multiple of 8)")  # fmt: skip
        self.out_features, self.in_features = weight.shape
        self.panels_bf16 = weight.dtype == torch.bfloat16 and bf16_dot()
        if self.panels_bf16:  # AVX-512: panels by pairs of k, [N/32][K/2][32][2]
            padded = _pad_rows(weight.contiguous(), PANEL)
            panels = padded.view(-1, PANEL, self.in_features // 2, 2).permute(0, 2, 1, 3).contiguous()
            self.weight = panels.view(torch.int16)
        elif weight.dtype == torch.bfloat16:
            padded = _pad_rows(weight.contiguous())
            tiles = padded.view(-1, TILE, self.in_features // 8, 8).permute(0, 2, 1, 3).contiguous()
            self.weight = tiles.view(torch.int16)
        else:
            padded = _pad_rows(weight.contiguous(), PANEL)
            self.weight = padded.view(-1, PANEL, self.in_features).transpose(1, 2).contiguous()
        self.bias = None if bias is None else bias.float().contiguous()
        self.checked = library().matmul_weight(self.projection(), self.out_features, self.in_features)

    def projection(self) -> Projection:
        """This weight as the kernels take it (float32 panels, or bfloat16 bits in this build's layout)."""
        return Projection(F32 if self.weight.dtype == torch.float32 else BF16, self.weight, None, self.bias)

    def unpacked(self) -> torch.Tensor:
        """The weight as a float32 ``[N, K]`` matrix (a new tensor; bfloat16 widens exactly)."""
        if self.weight.dtype == torch.float32:
            return self.weight.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features].contiguous()
        rows = self.weight.view(torch.bfloat16).permute(0, 2, 1, 3).reshape(-1, self.in_features)
        return rows[: self.out_features].float()  # either layout: [tiles, K-ish, rows, k-ish] -> [N, K]

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows @ W.T (+ bias)``: float32 rows give float32 rows; on the AVX-512 build bfloat16 rows
        against a bfloat16 weight give bfloat16 rows (the float32 sums rounded as ``.to`` rounds them)
        with no conversion on either side."""
        m = rows.shape[0]
        if self.weight.dtype == torch.float32:
            rows = rows.float().contiguous()
            out = rows.new_empty(m, self.out_features)
            library().matmul(self.checked, rows, out)
            return out
        scratch = None
        if rows.dtype == torch.bfloat16 and self.panels_bf16:
            rows = rows.contiguous()  # bfloat16 rows in, bfloat16 rows out
        else:
            rows = rows.float().contiguous()
            if self.panels_bf16:  # the rows rounded to bfloat16 once, for both threads
                scratch = torch.empty(m * self.in_features, dtype=torch.int16)
        out = rows.new_empty(m, self.out_features)
        library().matmul(self.checked, rows, out, bf16_rows=scratch)
        return out


class PackedQ8:
    """An int8 weight in the ``[N/4][K/32][4][32]`` layout with one scale per row or per 32 columns
    (Q8_0); calls round the activations to Q8_0 blocks and return float32 rows."""

    __slots__ = ("weight", "scale", "grouped", "bias", "out_features", "in_features", "checked")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        if library() is None:
            raise ValueError(f"PackedQ8: tierserve's CPU kernels are unavailable: {unavailable_reason()}")
        if not supports_q8(q):
            raise ValueError(f"PackedQ8 cannot hold a {q.device.type} {q.dtype} {list(q.shape)} weight (CPU, width a "
                             f"multiple of {QK})")  # fmt: skip
        self.out_features, self.in_features = q.shape
        blocks = self.in_features // QK
        # -128 has no positive twin for the sign trick (cpu_gemm.c); llama.cpp's quantizer never writes it
        q = _pad_rows(q.clamp(-127, 127))
        self.weight = q.view(-1, TILE, blocks, QK).permute(0, 2, 1, 3).contiguous()
        self.grouped = scale.dim() == 2
        scale = _pad_rows(scale.float())
        self.scale = (scale.view(-1, TILE, blocks).permute(0, 2, 1) if self.grouped else scale).contiguous()
        self.bias = None if bias is None else bias.float().contiguous()
        self.checked = library().matmul_weight(self.projection(), self.out_features, self.in_features)

    def projection(self) -> Projection:
        """This weight as the kernels take it."""
        return Projection(Q8_GROUPED if self.grouped else Q8_ROW, self.weight, self.scale, self.bias)

    def rows(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q [n, K], scale)`` of output rows ``index`` (an embedding lookup in a tied head)."""
        tile, within = index // TILE, index % TILE
        q = self.weight[tile, :, within, :].reshape(index.shape[0], self.in_features)
        scale = self.scale[tile, :, within] if self.grouped else self.scale[index]
        return q, scale

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        rows = rows.float().contiguous()
        m = rows.shape[0]
        out = rows.new_empty(m, self.out_features)
        quantized = torch.empty(m, self.in_features, dtype=torch.int8)
        block_scales = rows.new_empty(m, self.in_features // QK)
        library().matmul(self.checked, rows, out, q8_rows=quantized, q8_scales=block_scales)
        return out


class PackedQ4:
    """A GGUF Q4_0, Q4_1, Q5_0, Q5_1, Q4_K or Q5_K weight in ``ts_q4_gemm``'s layout (cpu_gemm.c): the file's
    blocks regrouped by tiles of 4 rows, the same bytes (16 of nibbles per 32 weights, the Q5 types' fifth bits
    after them, float16 scales and minimums; the K types' 6-bit block scales and minimums with each super-block's
    d and -dmin as float32: 4.75 and 5.75 bits a weight against the files' 4.5 and 5.5); calls round the
    activations to Q8_0 blocks (llama.cpp's vec_dot_q4_*) and return float32 rows."""

    __slots__ = ("nibbles", "scale", "mins", "bias", "out_features", "in_features", "kind")

    def __init__(self, kind: str, blocks: torch.Tensor, bias: torch.Tensor | None) -> None:
        """``blocks``: uint8 ``[out_features, in_features / weights a block, bytes a block]`` as the file stores
        them (``linear.BLOCK_LAYOUTS``, ``linear.BlockQ4``)."""
        from tierserve.plugins.backends.linear import BLOCK_LAYOUTS, block_nibbles, fifth_bits, k_scales

        if library() is None:
            raise ValueError(f"PackedQ4: tierserve's CPU kernels are unavailable: {unavailable_reason()}")
        width, per = BLOCK_LAYOUTS.get(kind, (None, QK))
        if width is None or blocks.dtype != torch.uint8 or blocks.dim() != 3 or blocks.shape[2] != width:
            raise ValueError(f"PackedQ4: {kind} blocks must be uint8 [out, in / {per}, {width}] (of "
                             f"{', '.join(BLOCK_LAYOUTS)}); got {blocks.dtype} {list(blocks.shape)}")  # fmt: skip
        self.kind = kind
        self.out_features = blocks.shape[0]
        blocks = _pad_rows(blocks.cpu())
        tiles = blocks.shape[0] // TILE

        def by_tile(part: torch.Tensor) -> torch.Tensor:  # [N, groups, w] -> [N/4, groups, 4, w]
            return part.reshape(tiles, TILE, part.shape[1], -1).permute(0, 2, 1, 3).contiguous()

        nibbles = by_tile(block_nibbles(kind, blocks))  # [N/4, groups, 4, 16]
        if kind in ("Q5_0", "Q5_1", "Q5_K"):  # per tile block: the 4 rows' bits of weights 0-15, then of 16-31
            high = fifth_bits(kind, blocks)  # [N, groups]
            halves = torch.stack([high & 0xFFFF, high >> 16], -1).to(torch.int32).to(torch.int16)  # [N, groups, 2]
            halves = halves.reshape(tiles, TILE, -1, 2).permute(0, 2, 3, 1).contiguous()  # [N/4, groups, 2, 4]
            groups = nibbles.shape[1]
            nibbles = torch.cat([nibbles.reshape(tiles, groups, -1), halves.view(torch.uint8).reshape(tiles, groups, -1)],
                                -1).contiguous()  # fmt: skip
        self.nibbles = nibbles
        if kind in ("Q4_K", "Q5_K"):
            d, dmin, scales, mins = k_scales(blocks)
            supers = d.shape[1]

            def per_super(small: torch.Tensor, big: torch.Tensor) -> torch.Tensor:  # [tiles, supers, 48] bytes
                small = small.reshape(tiles, TILE, supers, 8).permute(0, 2, 3, 1).reshape(tiles, supers, 32)
                big = big.reshape(tiles, TILE, supers).transpose(1, 2).contiguous().view(torch.uint8)
                return torch.cat([small, big], -1).contiguous()

            self.scale, self.mins = per_super(scales, d), per_super(mins, -dmin)
        else:
            self.scale = by_tile(blocks[:, :, 0:2]).view(torch.float16)[..., 0].contiguous()
            with_min = kind in ("Q4_1", "Q5_1")
            self.mins = by_tile(blocks[:, :, 2:4]).view(torch.float16)[..., 0].contiguous() if with_min else None
        self.in_features = self.nibbles.shape[1] * QK
        self.bias = None if bias is None else bias.float().contiguous()

    def projection(self) -> Projection:
        """This weight as ``ts_decode_layers`` takes it."""
        return Projection(Q4_KINDS[self.kind], self.nibbles, self.scale, self.bias, self.mins)

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        rows = rows.float().contiguous()
        out = rows.new_empty(rows.shape[0], self.out_features)
        library().q4_matmul(self.nibbles, self.scale, self.mins, self.bias, rows, out)
        return out


Q4_KINDS = {"Q4_0": Q4_0, "Q4_1": Q4_1, "Q4_K": Q4_K, "Q5_0": Q5_0, "Q5_1": Q5_1, "Q5_K": Q5_K}


class PackedQ6K:
    """A GGUF Q6_K weight in ``ts_q6k_gemm``'s layout (cpu_gemm.c: tiles of 4 rows; per block of 32 the rows'
    nibbles and high bit pairs, 26.5 bytes per 32 weights against the file's 26.25); calls round the activations
    to Q8_0 blocks and return float32 rows."""

    __slots__ = ("bits", "scale", "d", "bias", "out_features", "in_features")
    kind = "Q6_K"

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None) -> None:
        """``q`` uint8 ``[out, in]`` 6-bit values, ``scales`` int8 ``[out, in / 16]``, ``d`` float32
        ``[out, in / 256]`` (``linear.BlockQ6K.values``): weight ``i`` of a row is ``d * scales[i // 16] * (q - 32)``."""
        if library() is None:
            raise ValueError(f"PackedQ6K: tierserve's CPU kernels are unavailable: {unavailable_reason()}")
        self.out_features, self.in_features = q.shape
        if self.in_features % (QK * Q6_SUPER):
            raise ValueError(f"PackedQ6K: the width {self.in_features} is not whole super-blocks of {QK * Q6_SUPER}")
        blocks = self.in_features // QK
        q, scales, d = (_pad_rows(t.cpu()) for t in (q, scales, d))
        tiles = q.shape[0] // TILE

        def by_tile(part: torch.Tensor) -> torch.Tensor:  # [N, blocks * w] -> [N/4, blocks, 4, w]
            return part.reshape(tiles, TILE, blocks, -1).permute(0, 2, 1, 3).contiguous()

        q = q.reshape(-1, blocks, QK)
        nibbles = (q[..., :16] & 0xF) | ((q[..., 16:] & 0xF) << 4)
        high = q >> 4  # weights b, 8 + b, 16 + b, 24 + b of a block share byte b
        pairs = high[..., 0:8] | (high[..., 8:16] << 2) | (high[..., 16:24] << 4) | (high[..., 24:32] << 6)
        self.bits = torch.cat([by_tile(nibbles).reshape(tiles, blocks, -1), by_tile(pairs).reshape(tiles, blocks, -1)],
                              -1).contiguous()  # fmt: skip
        self.scale = by_tile(scales).transpose(2, 3).contiguous()  # [N/4, blocks, 2, 4]: first halves, then second
        self.d = d.reshape(tiles, TILE, -1).transpose(1, 2).contiguous()  # [N/4, in / 256, 4]
        self.bias = None if bias is None else bias.float().contiguous()

    def projection(self) -> Projection:
        """This weight as ``ts_decode_layers`` takes it."""
        return Projection(Q6_K, self.bits, self.scale, self.bias, self.d)

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        rows = rows.float().contiguous()
        out = rows.new_empty(rows.shape[0], self.out_features)
        library().q6k_matmul(self.bits, self.scale, self.d, self.bias, rows, out)
        return out


def supports_blocks(kind: str, in_features: int) -> bool:
    """Whether GGUF blocks of ``kind`` (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) run here at this input width."""
    per_block = QK * Q6_SUPER if kind in ("Q4_K", "Q5_K", "Q6_K") else QK  # a super-block of 256, or a block of 32
    return library() is not None and in_features % per_block == 0


def supports_float(weight: torch.Tensor) -> bool:
    """Whether ``PackedFloat`` can hold ``weight`` (CPU, float32/bfloat16, input width a multiple of 8)."""
    return weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16) and weight.shape[1] % 8 == 0


def supports_q8(q: torch.Tensor) -> bool:
    """Whether ``PackedQ8`` can hold ``q`` (CPU, input width a multiple of 32)."""
    return q.device.type == "cpu" and q.shape[1] % QK == 0


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: torch.Tensor,
    block_size: int,
    ctx: int,
    mask: torch.Tensor | None,
    scale: float,
    with_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """Attention of one query token per sequence (``q: [batch, heads, head_dim]``) read straight from the
    paged arena (``[slots, kv_heads, head_dim]``) through ``blocks: [batch, n]``, no gather; ``mask``
    (bool, ``batch * ctx`` elements) keeps positions. ``with_lse``: also each row's float32 log-sum-exp
    ``[batch, heads]`` (for ``merge_attention``). None where the kernel cannot run (the caller's torch
    path does)."""
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    if (
        q.device.type != "cpu"
        or k_cache.dtype not in (torch.float32, torch.bfloat16)
        or v_cache.dtype != k_cache.dtype
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or head_dim % 8
        or heads % kv_heads
        or heads // kv_heads > MAX_HEADS_PER_KV_HEAD
    ):
        return None
    lib = library()
    if lib is None:
        return None
    queries = q.float().contiguous()
    out = torch.empty(batch, heads, head_dim)
    scratch = torch.empty(batch * heads * ctx)
    table = blocks.to(torch.int64).contiguous()
    keep = None if mask is None else mask.reshape(batch, ctx).contiguous().view(torch.uint8)
    lse = torch.empty(batch, heads) if with_lse else None
    lib.decode_attention(queries, k_cache, v_cache, table, block_size, ctx, keep, scale, out, scratch, lse,
                         bf16_queries=q.dtype == torch.bfloat16)  # fmt: skip
    return (out.to(q.dtype), lse) if with_lse else out.to(q.dtype)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: torch.Tensor,
    block_size: int,
    ctx: int,
    mask: torch.Tensor | None,
    scale: float,
    causal: bool = True,
    with_lse: bool = False,
    round_queries: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """Attention of ``q_len`` query tokens for each of ``batch`` sequences (``q: [batch * q_len, heads,
    head_dim]``, sequence by sequence) read straight from the paged arena through ``blocks: [batch, n]``, no
    gather; ``mask`` (bool, ``batch * q_len * ctx`` elements) keeps positions, ``None`` is causal with the
    queries the last ``q_len`` of ``ctx`` positions (``causal=False``: every query sees all ``ctx`` positions).
    ``with_lse``: also each row's float32 log-sum-exp ``[batch * q_len, heads]`` (for ``merge_attention``).
    None where the kernel cannot run (the AVX-512 build only: the caller's torch path runs).

    bfloat16 keys and values against bfloat16 queries (a bfloat16 model's) multiply by vdpbf16ps: the
    query-key products exactly, and the softmax weights rounded to bfloat16 for their products with the
    values (as torch's bfloat16 attention rounds them), their sum kept in float32. ``round_queries`` with
    bfloat16 keys and values: float32 queries are rounded to bfloat16 first and take that form too (as
    llama.cpp's F16 cache rounds its queries to F16); the output stays float32. Otherwise every product is
    float32."""
    rows, heads, head_dim = q.shape
    batch = blocks.shape[0]
    kv_heads = k_cache.shape[1]
    if (
        q.device.type != "cpu"
        or k_cache.dtype not in (torch.float32, torch.bfloat16)
        or v_cache.dtype != k_cache.dtype
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or heads % kv_heads
        or rows % batch
        or (mask is not None and mask.numel() != rows * ctx)
    ):
        return None
    lib = library()
    if lib is None or not lib.has_prefill_attention:
        return None
    bf16_queries = q.dtype == torch.bfloat16 or (round_queries and k_cache.dtype == torch.bfloat16)
    queries = (q.to(torch.bfloat16) if bf16_queries else q).float().contiguous()
    out = torch.empty(rows, heads, head_dim)
    table = blocks.to(torch.int64).contiguous()
    keep = None if mask is None else mask.reshape(rows, ctx).contiguous().view(torch.uint8)
    lse = torch.empty(rows, heads) if with_lse else None
    lib.prefill_attention(queries, k_cache, v_cache, table, block_size, ctx, keep, scale, out, lse, causal=causal,
                          bf16_queries=bf16_queries)  # fmt: skip
    return (out.to(q.dtype), lse) if with_lse else out.to(q.dtype)


def merge_attention(
    a: torch.Tensor, lse_a: torch.Tensor, b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor | None:
    """``paged_attention.merge_attention`` of two CPU results ``[rows, heads, head_dim]`` and their float32
    log-sum-exps ``[rows, heads]`` in one call, in ``a``'s dtype (float32 arithmetic, the same order); the
    fused decode merges a shared prefix's part with this code, so both paths give the same bits. None where
    the library is missing."""
    lib = library()
    if lib is None or a.device.type != "cpu" or a.shape != b.shape:
        return None
    first, second = a.float().contiguous(), b.float().contiguous()
    first_lse, second_lse = lse_a.float().contiguous(), lse_b.float().contiguous()
    out = torch.empty(first.shape)
    lib.merge_attention(first, first_lse, second, second_lse, out)
    return out.to(a.dtype)


# rows up to which rms_norm (one thread) beats torch's five ops (5-30 us each): decode rows, or their heads
NORM_ROWS = 64
# elements up to which the layer loop's norms run it all the same (256 rows of 768): torch's fused op splits
# more than 32k elements among the threads, and in a prefill step it took ~155 us for 72 x 768 rows against
# ~40 us on one thread (the 2-vCPU host); past this a row count the threads share is the better split
LOOP_NORM_ELEMENTS = 256 * 768


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, max_elements: int | None = None
) -> torch.Tensor | None:
    """Hugging Face's RMSNorm of up to ``NORM_ROWS`` float32 or bfloat16 CPU rows (``max_elements``: or more
    rows of at most that many elements in all) in one call, on one thread (bfloat16: normalised in float32,
    rounded, times the weight, rounded, as ``llama.rms_norm``); None where torch's ops should run."""
    rows = x.numel() // x.shape[-1]
    too_many = rows > NORM_ROWS and (max_elements is None or x.numel() > max_elements)
    if (
        x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu" or too_many
        or weight.dtype != x.dtype or not weight.is_contiguous() or weight.shape != x.shape[-1:]
    ):  # fmt: skip
        return None
    lib = library()
    if lib is None:
        return None
    if x.dtype == torch.bfloat16:  # bfloat16 values are exact in float32
        rows_f32, weight_f32 = x.float().contiguous(), weight.float()  # held until the call returns
        out = torch.empty(x.shape)
        lib.rms_norm(rows_f32, weight_f32, eps, out, bf16=True)
        return out.to(torch.bfloat16)
    x = x.contiguous()
    out = torch.empty_like(x)
    lib.rms_norm(x, weight, eps, out)
    return out


def unit_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """fbgemm's input as ``Int8Linear`` builds it, in one call: float32 CPU rows ``[M, K]`` each divided by
    its largest |x| (at least 1e-12), with a last row of (1, -1, 0, ...), and the divisors ``[M, 1]``; the
    same bits as torch's ops. None where torch's ops should run."""
    if rows.dim() != 2 or rows.dtype != torch.float32 or rows.device.type != "cpu":
        return None
    lib = library()
    if lib is None:
        return None
    rows = rows.contiguous()
    out = rows.new_empty(rows.shape[0] + 1, rows.shape[1])
    norms = rows.new_empty(rows.shape[0], 1)
    lib.unit_rows(rows, out, norms)
    return out, norms


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` of float32 or bfloat16 CPU rows ``[M, 2I]`` (gate first; bfloat16: each result
    rounded as torch's ops round it), the rows shared among torch's threads; None where torch's ops should run."""
    dtype = gate_up.dtype
    if gate_up.dim() != 2 or dtype not in (torch.float32, torch.bfloat16) or gate_up.device.type != "cpu":
        return None
    lib = library()
    if lib is None:
        return None
    gate_up = gate_up.contiguous()  # bfloat16: its bits in and out, widened and narrowed inside the kernel
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    lib.silu_mul(gate_up, out)
    return out
