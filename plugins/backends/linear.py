"""Dense layers for the paged backends: float weights prepacked for oneDNN on CPU, int8 weights for fbgemm.

PyTorch's CPU ``F.linear`` calls MKL, whose fp32 GEMV/GEMM reached 16 GB/s of
weight reads on the 2-core AMD machine this was tuned on, while the same
matmuls through oneDNN with a prepacked weight reached 37-60 GB/s (2.5-4x
faster at every batch size from 1 to 256). Decode is a GEMV over all weights,
so this is most of a token's cost. Results differ from MKL only in summation
order (about 1e-6 relative).

``model.quantization = "int8"`` stores every matrix as int8 with one float
scale per output channel (symmetric, ``scale = max|w_row| / 127``, computed at
load from the float checkpoint, as llama.cpp's Q8_0 and torchao's int8
weight-only do, with a row instead of a 32-block). Kernels, fastest first:

- ``fbgemm``: ``torch.ops.quantized.linear_dynamic`` on x86 CPUs. It also
  quantizes the activations, per call, to 7 bits (``reduce_range``: no int16
  saturation on CPUs without VNNI) as llama.cpp's Q8_0 matmul quantizes them
  to 8-bit blocks. The op picks one activation grid for the whole input, from
  its min and max, so each row is first divided by its own max |x| (and its
  output multiplied back), and one extra row holding +1 and -1 pins the grid
  to [-1, 1] for every call: a row is rounded the same whatever else is in the
  batch (one sequence's outlier never coarsens another's, and a request gives
  the same output alone or batched). On a 2-core AVX2 EPYC: 2.7x the speed of
  oneDNN float32 at batch 1 with every weight streamed from memory, 1.7-2x at 32.
- ``weight_only``: ``torch._weight_int8pack_mm`` (the op torchao's int8
  weight-only layout calls on CPU) with bfloat16 activations: no activation
  rounding beyond bfloat16, 1.3x float32's speed at batch 1 on that machine.
- ``dequantize``: ``F.linear`` over the weight converted back per call, for
  devices with neither op (correct, 1 byte per weight held, not fast).

- ``q8`` (tierserve's own, ``cpu_gemm.py``, x86 with AVX2 and a C compiler):
  llama.cpp's Q8_0 dot product, the activations rounded to int8 in blocks of
  32. ``auto`` runs it for calls of at most ``SMALL_BATCH`` rows (decode of a
  few sequences), where it is 1.4-2x fbgemm's speed, and fbgemm above, where
  fbgemm's blocked GEMM is 1.5x (32 rows) to 2x (128 rows) faster. Each kernel alone gives a row the same
  result whatever else is in the batch; a sequence decoded alone and in a
  batch of more than ``SMALL_BATCH`` runs different kernels, so its output may
  differ by that rounding.

Group-wise int8 (``GroupedInt8``: one scale per 32 input columns of a row) is
llama.cpp's Q8_0 layout, and a GGUF file's Q8_0 tensors load into it as they
are, at 1.125 bytes per weight held. None of torch's ops takes more than one
scale per row, so these layers run ``int8-g32-q8`` (the ``q8`` kernel with the
file's own scales at every batch size: llama.cpp's arithmetic), or where that
kernel cannot run ``int8-g32``: per tile of output columns the int8 values
are converted to float and multiplied by the unrounded activations group by
group (one bmm), and the per-group sums scaled and added, so the output is the
dequantized weight's up to float summation order; 3-7x slower.

On ``cpu_gemm``'s AVX-512 build ``auto`` runs float32 weights on its
``f32-panels`` kernel and bfloat16 weights on ``bf16-panels`` (vdpbf16ps) at
every batch size, one copy of each weight held: panels of 32 output columns
times up to 12 rows in registers, each output element one chain of sums in
a fixed order, so a row's bits do not depend on its batch, and a decode step
of bfloat16 weights can run as one C call (``fused_decode.py``). Both were
faster than oneDNN's prepacked GEMM there from 1 to 2048 rows (the README
has the figures); ``onednn`` still picks oneDNN. Elsewhere (AVX2) float
weights run oneDNN where it works. Where oneDNN lacks bfloat16, ``auto``
runs tierserve's ``bf16`` kernel (``cpu_gemm.py``: the weight widened to
float32 in registers, float32 sums), 1.5x torch's ``F.linear`` at batch 1 and
5x at batch 32 on the AVX2 machine. Its two-rows-by-four-columns blocking
reaches ~90 GFLOP/s on that machine, so calls of ``WIDE_ROWS`` rows or more
(prefill chunks) widen the weight to float32 for the call and run oneDNN's
float32 GEMM (``bf16-avx2+onednn-f32``): the same float32 products of the
same bfloat16 values, summed in oneDNN's order. A decode row that shares its
step with a long prefill chunk therefore runs oneDNN's sums, not the bf16
kernel's, and may differ in its last bits from the same row run without one.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tierserve.plugins.backends import cpu_gemm

log = logging.getLogger(__name__)

KERNELS = ("auto", "onednn", "torch")
# GGUF blocks run as stored: read from a file (gguf), or rounded at load (block_quantize.BLOCK_QUANTIZATIONS)
BLOCK_MODES = ("gguf", "q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k", "q4_k_m", "q5_k_m")
QUANTIZATIONS = ("none", "int8", *BLOCK_MODES)
GROUP_SIZE = 32  # llama.cpp's Q8_0 block
GROUPED_KERNEL = "int8-g32"
SMALL_BATCH = 4  # rows up to which ``auto`` int8 runs the q8 kernel instead of fbgemm
# rows (a prefill chunk) from which bf16-avx2 hands a call to oneDNN's float32 GEMM, the weight widened for it
WIDE_ROWS = 256
_TILE_BYTES = 4 << 20  # float bytes of one converted column tile of a group-wise matrix


@dataclass(slots=True)
class GroupedInt8:
    """An int8 matrix with one float32 scale per ``GROUP_SIZE`` input columns of each row:
    ``w[n, k] = q[n, k] * scale[n, k // GROUP_SIZE]`` (llama.cpp's Q8_0 blocks, scales widened from float16)."""

    q: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # float32 [out, in // GROUP_SIZE]

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def to(self, device: torch.device) -> GroupedInt8:
        return GroupedInt8(self.q.to(device), self.scale.to(device))

    def dequantize(self, dtype: torch.dtype, rows: slice = slice(None)) -> torch.Tensor:
        """Rows ``rows`` of the float matrix, computed in float32 (exact) and then cast to ``dtype``."""
        q = self.q[rows]
        return (q.view(q.shape[0], -1, GROUP_SIZE) * self.scale[rows, :, None]).view(q.shape).to(dtype)


# bytes of a block as a GGUF file stores it, and the weights it holds
BLOCK_LAYOUTS = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q5_0": (22, 32), "Q5_1": (24, 32), "Q4_K": (144, 256),
                 "Q5_K": (176, 256)}  # fmt: skip


@dataclass(slots=True)
class BlockQ4:
    """A GGUF Q4_0, Q4_1, Q5_0, Q5_1, Q4_K or Q5_K matrix kept as the file stores it (llama.cpp's block_q4_0 ...
    block_q5_K, ``BLOCK_LAYOUTS`` bytes each). Weight i of a block of 32 is the low nibble of byte i (i < 16) or
    the high nibble of byte i - 16, plus (Q5 types) 16 times its fifth bit; w = d * (q - 8) (Q4_0), d * (q - 16)
    (Q5_0), d * q + m (Q4_1, Q5_1), or, in the super-blocks of 256 of Q4_K and Q5_K, d * scale * q - dmin * min
    with a 6-bit scale and minimum per block of 32."""

    kind: str  # a key of BLOCK_LAYOUTS
    blocks: torch.Tensor  # uint8 [out, in // weights a block, bytes a block]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.blocks.shape[0], self.blocks.shape[1] * BLOCK_LAYOUTS[self.kind][1]))

    def to(self, device: torch.device) -> BlockQ4:
        return BlockQ4(self.kind, self.blocks.to(device))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float matrix, computed in float32 (each weight exactly: d and m are float16, the K types' block
        scales products of a float16 and a 6-bit integer), then ``dtype``."""
        nibbles = block_nibbles(self.kind, self.blocks).to(torch.int16)
        q = torch.cat([nibbles & 0xF, nibbles >> 4], -1)  # [out, in / 32, 32]
        if self.kind in ("Q5_0", "Q5_1", "Q5_K"):
            high = fifth_bits(self.kind, self.blocks)  # [out, in / 32] bit i: weight i
            q = q + (((high[..., None] >> torch.arange(32)) & 1) << 4).to(torch.int16)
        q = q.float()
        if self.kind in ("Q4_K", "Q5_K"):
            d, dmin, scales, mins = k_scales(self.blocks)
            step = (d[..., None] * scales.float()).flatten(1)[..., None]  # [out, in / 32, 1]
            low = (-(dmin[..., None] * mins.float())).flatten(1)[..., None]
            return (step * q + low).reshape(self.shape).to(dtype)
        d = self.blocks[..., 0:2].contiguous().view(torch.float16).float()
        if self.kind in ("Q4_0", "Q5_0"):
            w = d * (q - (8 if self.kind == "Q4_0" else 16))
        else:
            w = d * q + self.blocks[..., 2:4].contiguous().view(torch.float16).float()
        return w.reshape(self.shape).to(dtype)


def block_nibbles(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """Each block of 32's 16 bytes of nibbles, uint8 ``[rows, in / 32, 16]`` in Q4_0's order (weight i < 16: the
    low nibble of byte i); the K types' super-blocks hold theirs by 64 (block 2c in the low nibbles)."""
    rows = blocks.shape[0]
    if kind not in ("Q4_K", "Q5_K"):
        return blocks[..., -16:]
    q = blocks[..., -128:].reshape(rows, -1, 4, 32)  # chunk c: block 2c in the low nibbles, 2c + 1 in the high
    values = torch.stack([q & 0xF, q >> 4], 3).reshape(rows, -1, 32)
    return (values[..., :16] | (values[..., 16:] << 4)).contiguous()


def fifth_bits(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """The Q5 types' fifth bits, int64 ``[rows, in / 32]``: bit i of a block's value is its weight i's."""
    rows = blocks.shape[0]
    if kind == "Q5_K":  # bit s of byte l of the 32: weight l of block s of the super-block
        qh = blocks[..., 16:48].to(torch.int64)  # [rows, n, 32]
        bits = (qh[..., None, :] >> torch.arange(8)[:, None]) & 1  # [rows, n, 8, 32]
        return (bits << torch.arange(32)).sum(-1).reshape(rows, -1)
    at = 2 if kind == "Q5_0" else 4
    return blocks[..., at : at + 4].contiguous().view(torch.int32)[..., 0].to(torch.int64) & 0xFFFFFFFF


def k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_K or Q5_K super-block's ``(d, dmin, scales, mins)``: d and dmin float32 ``[rows, n]``, each block of
    32's 6-bit scale and minimum uint8 ``[rows, n, 8]`` (llama.cpp's get_scale_min_k4)."""
    rows, n = blocks.shape[:2]
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()[..., 0]
    dmin = blocks[..., 2:4].contiguous().view(torch.float16).float()[..., 0]
    packed = blocks[..., 4:16].to(torch.int32)
    scales = torch.empty(rows, n, 8, dtype=torch.int32)
    mins = torch.empty(rows, n, 8, dtype=torch.int32)
    scales[..., :4], mins[..., :4] = packed[..., 0:4] & 63, packed[..., 4:8] & 63
    scales[..., 4:] = (packed[..., 8:12] & 0xF) | ((packed[..., 0:4] >> 6) << 4)
    mins[..., 4:] = (packed[..., 8:12] >> 4) | ((packed[..., 4:8] >> 6) << 4)
    return d, dmin, scales.to(torch.uint8), mins.to(torch.uint8)


@dataclass(slots=True)
class BlockQ6K:
    """A GGUF Q6_K matrix kept at 6.5625 bits a weight: per row, ``in / 256`` super-blocks of 210 bytes as the
    file stores them (llama.cpp's block_q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales,
    a float16 d); weight ``i`` is ``d * scales[i // 16] * (q[i] - 32)`` with ``q`` 6-bit."""

    blocks: torch.Tensor  # uint8 [out, in // 256, 210]
    kind = "Q6_K"

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.blocks.shape[0], self.blocks.shape[1] * 256))

    def to(self, device: torch.device) -> BlockQ6K:
        return BlockQ6K(self.blocks.to(device))

    def values(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q, scales, d)``: the 6-bit values uint8 ``[out, in]`` in weight order (llama.cpp's
        dequantize_row_q6_K's), the int8 scales ``[out, in / 16]`` and d float32 ``[out, in / 256]``."""
        rows, supers = self.blocks.shape[:2]
        ql, qh = self.blocks[..., :128].to(torch.int16), self.blocks[..., 128:192].to(torch.int16)
        parts = []
        for half in range(2):  # 128 weights each: 64 bytes of nibbles, 32 of high pairs
            low, high = ql[..., 64 * half : 64 * half + 64], qh[..., 32 * half : 32 * half + 32]
            parts += [(low[..., :32] & 0xF) | ((high & 3) << 4), (low[..., 32:] & 0xF) | (((high >> 2) & 3) << 4),
                      (low[..., :32] >> 4) | (((high >> 4) & 3) << 4), (low[..., 32:] >> 4) | (((high >> 6) & 3) << 4)]  # fmt: skip
        q = torch.cat(parts, -1).to(torch.uint8).reshape(rows, supers * 256)
        scales = self.blocks[..., 192:208].contiguous().view(torch.int8).reshape(rows, supers * 16)
        d = self.blocks[..., 208:210].contiguous().view(torch.float16).float().reshape(rows, supers)
        return q, scales, d

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float matrix, computed in float32 as llama.cpp does (``d * scale``, then times ``q - 32``: exact),
        then ``dtype``."""
        q, scales, d = self.values()
        step = (d.repeat_interleave(16, 1) * scales.float()).repeat_interleave(16, 1)
        return (step * (q.float() - 32)).to(dtype)


class BlockLinear:
    """``y = x @ W.T + bias`` with ``W`` kept in its GGUF blocks: a ``BlockQ4`` (``cpu_gemm.PackedQ4``: llama.cpp's
    Q4 x Q8_0 dot product) or a ``BlockQ6K`` (``cpu_gemm.PackedQ6K``), the activations rounded to Q8_0 blocks."""

    __slots__ = ("packed", "out_features", "dtype", "kernel")

    def __init__(self, weight: BlockQ4 | BlockQ6K, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        if isinstance(weight, BlockQ6K):
            self.packed = cpu_gemm.PackedQ6K(*weight.values(), bias)
            self.kernel = "q6-k"
        else:
            self.packed = cpu_gemm.PackedQ4(weight.kind, weight.blocks, bias)
            self.kernel = f"q4-{weight.kind.lower().replace('_', '')}"  # q4-q40, q4-q41, q4-q4k
        self.out_features = weight.shape[0]
        self.dtype = dtype

    @property
    def bias(self) -> torch.Tensor | None:
        return self.packed.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        return self.packed(rows).to(self.dtype).view(*x.shape[:-1], self.out_features)


class SplitLinear:
    """A fused projection (q/k/v) whose parts are kept in different block types: each part runs its own
    kernel and the outputs are joined, so no part is re-quantized to share one."""

    __slots__ = ("parts", "out_features", "kernel")

    def __init__(self, parts: list[BlockLinear | Int8Linear]) -> None:
        self.parts = parts
        self.out_features = sum(part.out_features for part in parts)
        self.kernel = "+".join(part.kernel for part in parts)

    @property
    def bias(self) -> torch.Tensor | None:
        biases = [part.bias for part in self.parts]
        return None if any(b is None for b in biases) else torch.cat(biases)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], -1)


@dataclass(slots=True)
class RowParts:
    """Matrices stacked along their output rows that stay apart (``cat_rows`` of different GGUF block types)."""

    parts: list[BlockQ4 | BlockQ6K | GroupedInt8]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(part.shape[0] for part in self.parts), self.parts[0].shape[1]))


def quantize_groups(weight: torch.Tensor) -> GroupedInt8:
    """Q8_0's rule (``scale = max|w_group| / 127``, rounded half away from zero) over groups of ``GROUP_SIZE``."""
    rows, columns = weight.shape
    if columns % GROUP_SIZE:
        raise ValueError(f"group-wise int8 needs a multiple of {GROUP_SIZE} input columns, got {columns}")
    groups = weight.float().reshape(rows, -1, GROUP_SIZE)
    scale = groups.abs().amax(dim=2) / 127.0
    inverse = torch.where(scale == 0, torch.zeros_like(scale), 1.0 / scale)
    scaled = groups * inverse[:, :, None]
    q = (scaled.sign() * (scaled.abs() + 0.5).floor()).clamp_(-127, 127).to(torch.int8)
    return GroupedInt8(q.view(rows, columns), scale)


def _kept_kind(part: object) -> str | None:
    """The GGUF type a matrix is kept in (Q8_0 as int8 groups), or None for float."""
    if isinstance(part, (BlockQ4, BlockQ6K)):
        return part.kind
    return "Q8_0" if isinstance(part, GroupedInt8) else None


def cat_rows(
    parts: list[torch.Tensor | GroupedInt8 | BlockQ4 | BlockQ6K],
) -> torch.Tensor | GroupedInt8 | BlockQ4 | BlockQ6K | RowParts:
    """Stack matrices along their output rows (fused q/k/v, gate/up): one kept type (GGUF blocks of one type, or
    int8 groups) stays that type; GGUF blocks of several types (Q8_0 as int8 groups among them) give ``RowParts``
    (each keeps its kernel); blocks among float parts are re-quantized to int8 groups (logged); float stays float."""
    kinds = [_kept_kind(part) for part in parts]
    if None not in kinds and len(set(kinds)) == 1:
        if kinds[0] == "Q6_K":
            return BlockQ6K(torch.cat([part.blocks for part in parts], 0).contiguous())
        if kinds[0] == "Q8_0":
            return GroupedInt8(torch.cat([p.q for p in parts], 0), torch.cat([p.scale for p in parts], 0))
        return BlockQ4(kinds[0], torch.cat([part.blocks for part in parts], 0).contiguous())
    if None not in kinds:
        runs: list = []  # consecutive parts of one type joined
        for part, kind in zip(parts, kinds):
            if runs and _kept_kind(runs[-1]) == kind:
                runs[-1] = cat_rows([runs[-1], part])
            else:
                runs.append(part)
        return RowParts(runs)
    blocked = {kind for kind in kinds if kind not in (None, "Q8_0")}
    if blocked:
        log.warning("gguf_requantized kinds=%s: a fused projection mixes GGUF blocks with float weights, so it runs "
                    "as int8 groups", sorted(blocked))  # fmt: skip
        parts = [quantize_groups(part.dequantize()) if isinstance(part, (BlockQ4, BlockQ6K)) else part for part in parts]
    if not any(isinstance(part, GroupedInt8) for part in parts):
        return torch.cat(parts, 0).contiguous()
    grouped = [part if isinstance(part, GroupedInt8) else quantize_groups(part) for part in parts]
    return GroupedInt8(torch.cat([g.q for g in grouped], 0), torch.cat([g.scale for g in grouped], 0))


def _onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    try:  # bf16/fp16 need CPU support that a build may lack; a tiny call is the reliable probe
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.ones(4, 8, dtype=dtype))
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=dtype), weight, None, "none", [], "")
        return bool(torch.allclose(out.float(), torch.full((2, 4), 8.0)))
    except RuntimeError:
        return False


class Linear:
    """``y = x @ weight.T + bias`` with the weight stored in the kernel's preferred layout: oneDNN's
    (``packed``), tierserve's (``own``: ``cpu_gemm.PackedFloat``), or as it is for ``F.linear``.

    ``wide_prefill`` (with ``own``): calls of at least ``WIDE_ROWS`` rows run oneDNN's float32 GEMM on the
    weight widened to float32 for that call."""

    __slots__ = ("weight", "bias", "packed", "out_features", "own", "wide_prefill")

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        packed: bool,
        own: bool = False,
        wide_prefill: bool = False,
    ) -> None:
        self.out_features = weight.shape[0]
        self.bias = bias
        self.packed = packed
        self.own = cpu_gemm.PackedFloat(weight, bias) if own else None
        self.wide_prefill = wide_prefill and own
        if own:
            self.weight = self.own.weight
        else:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous()) if packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.own is not None:
            rows = x.reshape(-1, x.shape[-1])
            if self.wide_prefill and rows.shape[0] >= WIDE_ROWS:
                weight = torch.ops.mkldnn._reorder_linear_weight(self.own.unpacked())
                out = torch.ops.mkldnn._linear_pointwise(rows.float(), weight, self.own.bias, "none", [], "")
            else:
                out = self.own(rows)
            return out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        if self.packed:
            rows = x.reshape(-1, x.shape[-1])
            out = torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")
            return out.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: ``(q, scale)`` with ``weight ≈ q * scale[:, None]``, ``scale`` float32."""
    weight = weight.float()
    scale = (weight.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    q = torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def _fbgemm_pack(q: torch.Tensor, scale: torch.Tensor) -> object:
    with warnings.catch_warnings():  # quantized tensors are deprecated in favour of torchao; the kernel is not
        warnings.simplefilter("ignore")
        zero = torch.zeros(q.shape[0], dtype=torch.long)
        qweight = torch._make_per_channel_quantized_tensor(q, scale.double(), zero, 0)
        return torch.ops.quantized.linear_prepack(qweight, None)


# torch._weight_int8pack_mm's AVX-512 kernel (torch 2.13) reads past the input of a width that is not a
# multiple of 32: garbage or a segmentation fault. weight_only runs such matrices as dequantize does.
WEIGHT_ONLY_WIDTH = 32


def int8_kernels(device: torch.device) -> list[str]:
    """The int8 kernels that work here, fastest first (a tiny call is the probe)."""
    q, scale = quantize_rows(torch.arange(4 * WEIGHT_ONLY_WIDTH, dtype=torch.float32).view(4, -1) / 8 - 8)
    x = torch.ones(2, WEIGHT_ONLY_WIDTH)
    expected = x @ (q.float() * scale[:, None]).T
    found = []
    if device.type == "cpu" and "fbgemm" in torch.backends.quantized.supported_engines:
        try:
            out = torch.ops.quantized.linear_dynamic(x, _fbgemm_pack(q, scale), True)
            if torch.allclose(out, expected, rtol=0.05, atol=0.5):
                found.append("fbgemm")
        except (RuntimeError, AttributeError):
            pass
    try:
        out = torch._weight_int8pack_mm(
            x.to(device, torch.bfloat16), q.to(device), scale.to(device, torch.bfloat16)
        ).float().cpu()
        if torch.allclose(out, expected, rtol=0.05, atol=0.5):
            found.append("weight_only")
    except (RuntimeError, AttributeError, NotImplementedError):
        pass
    return [*found, "dequantize"]


class Int8Linear:
    """``y ≈ x @ (q * scale[:, None]).T + bias`` with ``q`` int8 (see the module docstring for the kernels).

    A float weight is quantized per row at construction; a ``GroupedInt8`` weight is kept
    as it is and runs ``grouped-q8`` (with ``small_batch``, where ``cpu_gemm`` runs) or ``grouped``
    whatever ``kernel`` says. ``kernel = "q8"`` runs tierserve's q8 kernel at every batch size;
    ``small_batch`` adds it to another per-row kernel for calls of at most ``SMALL_BATCH`` rows.
    For ``fbgemm`` the packed weight holds the scales; its op is kept as an ``OpOverload``, which
    called directly skips the Python dispatch checks (~17 µs a call, 49 calls a step).
    """

    __slots__ = ("kernel", "weight", "scale", "bias", "out_features", "dtype", "op", "span", "tile", "q8")

    def __init__(
        self,
        weight: torch.Tensor | GroupedInt8,
        bias: torch.Tensor | None,
        kernel: str,
        dtype: torch.dtype,
        small_batch: bool = False,
    ) -> None:
        self.dtype = dtype
        self.bias = bias
        self.op = self.span = self.q8 = None
        self.out_features = weight.shape[0]
        if isinstance(weight, GroupedInt8) and small_batch and cpu_gemm.supports_q8(weight.q):
            self.kernel = "grouped-q8"
            self.q8 = cpu_gemm.PackedQ8(weight.q, weight.scale, bias)
            self.weight, self.scale = self.q8.weight, self.q8.scale
            return
        if isinstance(weight, GroupedInt8):  # stored [groups, 32, out]: each group's block is one bmm operand
            rows, columns = weight.shape
            self.kernel = "grouped"
            self.weight = weight.q.view(rows, -1, GROUP_SIZE).permute(1, 2, 0).contiguous()
            self.scale = weight.scale.T.contiguous()  # [groups, out]
            self.tile = max(1, _TILE_BYTES // (4 * columns))
            return
        q, scale = quantize_rows(weight.cpu())
        device = weight.device
        if kernel == "weight_only" and device.type == "cpu" and q.shape[1] % WEIGHT_ONLY_WIDTH:
            kernel = "dequantize"
        self.kernel = kernel
        if kernel == "q8" or (small_batch and cpu_gemm.supports_q8(q)):
            self.q8 = cpu_gemm.PackedQ8(q, scale, bias)
        if kernel == "q8":
            self.weight, self.scale = self.q8.weight, self.q8.scale
        elif kernel == "fbgemm":
            self.weight, self.scale = _fbgemm_pack(q, scale), None
            self.op = torch.ops.quantized.linear_dynamic.default
            self.span = torch.zeros(1, q.shape[1])
            self.span[0, :2] = torch.tensor([1.0, -1.0])
        elif kernel == "weight_only":
            self.weight, self.scale = q.to(device), scale.to(device, torch.bfloat16)
        else:
            self.weight, self.scale = q.to(device), scale.to(device, dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.q8 is not None and (self.kernel in ("q8", "grouped-q8") or rows.shape[0] <= SMALL_BATCH):
            return self.q8(rows).to(self.dtype).view(*x.shape[:-1], self.out_features)  # bias included
        if self.kernel == "fbgemm":
            rows = rows.float()
            unit = cpu_gemm.unit_rows(rows)  # in one pass, the same bits as torch's ops below
            if unit is None:
                norms = rows.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12)
                unit = torch.cat([rows / norms, self.span]), norms
            out = self.op(unit[0], self.weight, True)[:-1].mul_(unit[1]).to(self.dtype)
        elif self.kernel == "grouped":
            out = self._grouped(rows.to(self.dtype))
        elif self.kernel == "weight_only":
            out = torch._weight_int8pack_mm(rows.to(torch.bfloat16), self.weight, self.scale).to(self.dtype)
        else:
            out = F.linear(rows.to(self.dtype), self.weight.to(self.dtype) * self.scale[:, None])
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def _grouped(self, rows: torch.Tensor) -> torch.Tensor:
        """Column tiles of the output. A few rows (decode): per-group partial products of the int8 values
        converted to float, then scaled and summed, so the weight is never scaled. Many rows (prefill):
        the tile's weight dequantized once, then one matmul."""
        groups = self.weight.shape[0]
        tokens = rows.shape[0]
        out = rows.new_empty(tokens, self.out_features)
        by_group = rows.view(tokens, groups, GROUP_SIZE).transpose(0, 1)  # [groups, tokens, 32]
        for start in range(0, self.out_features, self.tile):
            part = slice(start, start + self.tile)
            values = self.weight[:, :, part].to(self.dtype)  # [groups, 32, cols]
            if tokens <= GROUP_SIZE:
                partial = torch.bmm(by_group, values)  # [groups, tokens, cols]
                out[:, part] = (partial * self.scale[:, None, part]).sum(0)
            else:
                values.mul_(self.scale[:, None, part])
                out[:, part] = rows @ values.view(-1, values.shape[-1])
        return out


def bf16_copies(kernel: str, device: torch.device) -> int:
    """Copies held of each bfloat16 weight: one (the AVX-512 build's panels replaced oneDNN's copy next to
    the vdpbf16ps kernel's)."""
    return 1


def int8_copies(kernel: str, device: torch.device) -> int:
    """Bytes held per int8 weight quantized per row: ``auto`` on a CPU where ``cpu_gemm`` runs keeps the
    q8 kernel's packed copy next to fbgemm's (or the portable kernel's) weight."""
    return 2 if kernel == "auto" and device.type == "cpu" and cpu_gemm.library() is not None else 1


class LinearFactory:
    """Builds every dense layer of one model with one kernel choice.

    Float weights: ``auto`` is oneDNN where it works, ``torch`` is ``F.linear``.
    int8 weights: ``auto`` is the fastest int8 kernel that works here, ``torch``
    the portable one (``weight_only``, else ``dequantize``).
    """

    def __init__(
        self,
        kernel: str,
        device: torch.device,
        dtype: torch.dtype,
        quantization: str = "none",
        setting: str = "plugins.native.linear_kernel",
    ) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"{setting}: got {kernel!r}, allowed: {', '.join(KERNELS)}")
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"model.quantization: got {quantization!r}, allowed: {', '.join(QUANTIZATIONS)}")
        self.dtype = dtype
        # blocks rounded at load (q4_0, q4_1, q8_0) run as a GGUF file's: float matrices left over go to int8
        self.quantization = "gguf" if quantization in BLOCK_MODES else quantization
        self.grouped_kernel = ""
        self.block_kernels: set[str] = set()  # "q4", "q6k": the GGUF block kernels the layers built so far run
        self.device = device
        if self.quantization in ("int8", "gguf"):
            if kernel == "onednn":
                raise ValueError(
                    f"{setting}: 'onednn' runs float weights; with model.quantization = {quantization!r} "
                    "use 'auto' (the fastest int8 kernel here) or 'torch'"
                )
            kernels = int8_kernels(device)
            if kernel == "torch":
                kernels = [k for k in kernels if k != "fbgemm"]
            self.packed = self.own = self.wide_prefill = False
            self._int8_kernel = kernels[0]
            self.small_batch = kernel == "auto" and device.type == "cpu" and cpu_gemm.library() is not None
            self.kernel = f"int8-{kernels[0]}" + ("+q8" if self.small_batch else "")
            return
        available = _onednn_available(device, dtype)
        if kernel == "onednn" and not available:
            raise ValueError(
                f"{setting}: 'onednn' needs a CPU device and a PyTorch build with oneDNN "
                f"linear support for {dtype}; use 'auto' or 'torch'"
            )
        self.packed = available and kernel != "torch"
        # bfloat16 without oneDNN's support (no AVX512-BF16): F.linear widens the whole weight every call
        self.own = (
            kernel == "auto" and not available and dtype == torch.bfloat16
            and device.type == "cpu" and cpu_gemm.library() is not None
        )  # fmt: skip
        self.wide_prefill = self.own and _onednn_available(device, torch.float32)
        self.kernel = "onednn" if self.packed else "bf16-avx2" if self.own else "torch"
        if kernel == "auto" and dtype == torch.float32 and device.type == "cpu" and cpu_gemm.float_panels():
            self.own, self.kernel = True, "f32-panels"  # every batch size (oneDNN only for a matrix it cannot hold)
        if self.wide_prefill:
            self.kernel += "+onednn-f32"
        # the AVX-512 build's vdpbf16ps panels at every batch size (oneDNN only for a matrix they cannot hold)
        if kernel == "auto" and dtype == torch.bfloat16 and device.type == "cpu" and cpu_gemm.bf16_dot():
            self.own, self.wide_prefill, self.kernel = True, False, "bf16-panels"

    def __call__(
        self, weight: torch.Tensor | GroupedInt8 | BlockQ4 | BlockQ6K | RowParts, bias: torch.Tensor | None = None
    ) -> Linear | Int8Linear | BlockLinear | SplitLinear:
        """A layer for ``weight``: GGUF blocks stay so where ``cpu_gemm`` runs (else int8 groups, logged), group-wise
        int8 stays so (``int8-g32``), float follows the factory's choice."""
        if isinstance(weight, RowParts):
            sizes = [part.shape[0] for part in weight.parts]
            biases = [None] * len(sizes) if bias is None else list(bias.split(sizes))
            layers = [self(part, part_bias) for part, part_bias in zip(weight.parts, biases)]
            if all(isinstance(layer, (BlockLinear, Int8Linear)) for layer in layers):
                return SplitLinear(layers)
            weight = quantize_groups(torch.cat([part.dequantize() for part in weight.parts]))  # the parts' fallback
        if isinstance(weight, (BlockQ4, BlockQ6K)):
            if self.quantization != "gguf":
                raise ValueError("GGUF blocks load with model.quantization = 'gguf' only")
            if self.device.type == "cpu" and cpu_gemm.supports_blocks(weight.kind, weight.shape[1]):
                layer = BlockLinear(weight, bias, self.dtype)
                self.block_kernels.add("q4" if isinstance(weight, BlockQ4) else "q6k")
                return layer
            log.warning("gguf_requantized kind=%s: tierserve's CPU kernels do not run here (%s); int8 groups instead",
                        weight.kind, cpu_gemm.unavailable_reason() or self.device)  # fmt: skip
            weight = quantize_groups(weight.dequantize())
        if isinstance(weight, GroupedInt8):
            if self.quantization not in ("int8", "gguf"):
                raise ValueError("group-wise int8 weights load with model.quantization = 'int8' or 'gguf' only")
            layer = Int8Linear(weight, bias, "grouped", self.dtype, self.small_batch)
            self.grouped_kernel = GROUPED_KERNEL + ("-q8" if layer.kernel == "grouped-q8" else "")
            return layer
        if self.quantization in ("int8", "gguf"):
            return Int8Linear(weight, bias, self._int8_kernel, self.dtype, self.small_batch)
        own = self.own and cpu_gemm.supports_float(weight)
        return Linear(weight, bias, self.packed, own, self.wide_prefill)

    @property
    def kernels(self) -> str:
        """What runs the layers built so far, in words: ``kernel``, plus ``int8-g32`` (``int8-g32-q8``) when
        group-wise layers run, ``q4`` and ``q6k`` when GGUF Q4 and Q6_K blocks do."""
        return "+".join(part for part in (self.kernel, self.grouped_kernel, *sorted(self.block_kernels)) if part)


class KernelLinear(nn.Module):
    """A model's dense layer run by one of tierserve's kernels (``linear.py``): oneDNN prepacked or int8."""

    def __init__(self, layer: Linear | Int8Linear, in_features: int, out_features: int) -> None:
        super().__init__()
        self.layer, self.in_features, self.out_features = layer, in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def swap_linear_layers(model: nn.Module, factory: LinearFactory) -> int:
    """Replace every ``nn.Linear`` (and GPT-2's transposed ``Conv1D``) with a ``KernelLinear``; returns how many."""
    from transformers.pytorch_utils import Conv1D

    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                weight, (in_features, out_features) = child.weight.detach(), (child.in_features, child.out_features)
            elif isinstance(child, Conv1D):  # y = x @ W + b with W: [in, out]
                weight, (in_features, out_features) = child.weight.detach().t(), (child.weight.shape[0], child.nf)
            else:
                continue
            bias = None if child.bias is None else child.bias.detach()
            parent._modules[name] = KernelLinear(factory(weight.contiguous(), bias), in_features, out_features)
            swapped += 1
    return swapped
