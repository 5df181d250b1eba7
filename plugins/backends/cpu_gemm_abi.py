"""The C interface of ``cpu_gemm.c``'s shared objects, typed: one checked method per kernel.

``Kernels(path)`` loads one build and checks it against this module before
anything runs: its kernel version (``cpu_gemm_builds.KERNEL_VERSION``), each
argument struct's fields (names, offsets and sizes, as ``ts_layout`` reports
the C declaration) and the numbers both sides use (``ts_constants``). Each
call then checks every tensor it hands over (device, dtype, shape,
contiguity) and raises ``KernelArgumentError`` naming the kernel, the
argument, what it takes and what it got: the C code trusts every pointer.

    cpu_gemm.py (PackedQ8, decode_attention, ...)     what to compute; torch's path where it cannot
      -> Kernels.matmul_weight(Projection)            the packed weight, checked once
      -> Kernels.matmul(weight, x, out, ...)          each call's tensors checked, a Matmul struct
        -> ts_q8_gemm(const ts_matmul*)               cpu_gemm.c
      -> Kernels.q4_matmul(nibbles, scale, mins, ...) a GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K weight: ts_q4_gemm
      -> Kernels.q6k_matmul(bits, scales, d, ...)     a GGUF Q6_K weight: ts_q6k_gemm(const ts_q4_matmul*)
      -> Kernels.quantize_k(kind, x)                  float rows into Q4_K/Q5_K/Q6_K blocks: ts_quantize_k (k_quantize.c)
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tierserve.plugins.backends.cpu_gemm_builds import KERNEL_VERSION

QK = 32  # q8 block: llama.cpp's Q8_0
TILE = 4  # output rows of a bfloat16 (AVX2 build) or q8 tile
PANEL = 32  # output columns of a float32 or (AVX-512 build) bfloat16 panel
MAX_GROUP = 16  # query heads per KV head the attention kernels take
Q8_ROW, Q8_GROUPED, BF16, F32, Q4_0, Q4_1, Q4_K, Q6_K, Q5_0, Q5_1, Q5_K = range(11)  # a ts_layer projection's K_*
Q5_BLOCK = 80  # bytes of a Q5 tile's block of 32 weights: 4 rows x 16 of nibbles, then 16 of fifth bits
Q6_BLOCK = 96  # bytes of a Q6_K tile's block of 32 weights: 4 rows x (16 of nibbles + 8 of high bit pairs)
Q6_SUPER = 8  # blocks of 32 per Q6_K super-block (one d per row)
QK_K = 256  # weights a K-type super-block
K_SUPER_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # ts_quantize_k's output, a super-block
CONSTANTS = {"version": KERNEL_VERSION, "qk": QK, "tile": TILE, "panel": PANEL, "max_group": MAX_GROUP,
             "q8_row": Q8_ROW, "q8_grouped": Q8_GROUPED, "bf16": BF16, "f32": F32, "q4_0": Q4_0,
             "q4_1": Q4_1, "q4_k": Q4_K, "q6_k": Q6_K, "q5_0": Q5_0, "q5_1": Q5_1, "q5_k": Q5_K}  # fmt: skip

_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
FLOAT32, FLOATS, INT8, INT16, INT64, UINT8 = (
    (torch.float32,), (torch.float32, torch.bfloat16), (torch.int8,), (torch.int16,), (torch.int64,), (torch.uint8,)
)


class KernelLoadError(RuntimeError):
    """A shared object that is not the build this code binds (another version, another struct layout)."""


class KernelArgumentError(ValueError):
    """A kernel was handed a tensor it cannot take: the C code would read or write past it."""


class Matmul(ctypes.Structure):
    """``ts_matmul``: the arguments of ``ts_f32_gemm``, ``ts_bf16_gemm`` and ``ts_q8_gemm``."""

    _fields_ = [("x", _p), ("rows", _i64), ("in_features", _i64), ("weight", _p), ("scale", _p), ("bias", _p),
                ("out_features", _i64), ("out", _p), ("grouped", _i32), ("io", _i32), ("bf16_rows", _p),
                ("q8_rows", _p), ("q8_scales", _p), ("threads", _i32)]  # fmt: skip


class Q4Matmul(ctypes.Structure):
    """``ts_q4_matmul``: the arguments of ``ts_q4_gemm`` (a GGUF Q4_0 / Q4_1 weight kept as stored)."""

    _fields_ = [("x", _p), ("rows", _i64), ("in_features", _i64), ("nibbles", _p), ("scale", _p), ("mins", _p),
                ("k_scales", _i32), ("high_bits", _i32), ("bias", _p), ("out_features", _i64), ("out", _p), ("q8_rows", _p), ("q8_scales", _p),
                ("q8_sums", _p), ("q8_block_sums", _p), ("threads", _i32)]  # fmt: skip


class Attention(ctypes.Structure):
    """``ts_attention``: the arguments of ``ts_decode_attention`` and ``ts_prefill_attention``."""

    _fields_ = [("q", _p), ("batch", _i64), ("q_len", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64),
                ("k", _p), ("v", _p), ("flags", _i32), ("causal", _i32), ("blocks", _p), ("blocks_per_row", _i64),
                ("block_size", _i64), ("ctx", _i64), ("keep", _p), ("scale", _f32), ("out", _p), ("scores", _p),
                ("lse", _p), ("threads", _i32)]  # fmt: skip


class Layer(ctypes.Structure):
    """``ts_layer``: one layer of ``ts_decode_layers`` (its weights, arena, positions and projection kinds)."""

    _fields_ = [("input_norm", _p), ("qkv_weight", _p), ("qkv_scale", _p), ("qkv_bias", _p), ("q_norm", _p),
                ("k_norm", _p), ("o_weight", _p), ("o_scale", _p), ("o_bias", _p), ("post_norm", _p),
                ("gate_up_weight", _p), ("gate_up_scale", _p), ("down_weight", _p), ("down_scale", _p),
                ("qkv_mins", _p), ("o_mins", _p), ("gate_up_mins", _p), ("down_mins", _p), ("k_cache", _p), ("v_cache", _p), ("keep", _p), ("qkv_kind", _i32), ("o_kind", _i32),
                ("gate_up_kind", _i32), ("down_kind", _i32), ("qkv_tail_weight", _p), ("qkv_tail_scale", _p),
                ("qkv_tail_mins", _p), ("qkv_tail_bias", _p), ("qkv_tail_rows", _i64), ("qkv_tail_kind", _i32)]  # fmt: skip


class DecodeStep(ctypes.Structure):
    """``ts_decode_step``: the arguments of ``ts_decode_layers``."""

    _fields_ = [("rows", _i64), ("layers", _i64), ("hidden_size", _i64), ("heads", _i64), ("kv_heads", _i64),
                ("head_dim", _i64), ("intermediate_size", _i64), ("eps", _f32), ("scale", _f32), ("act_bf16", _i32),
                ("kv_bf16", _i32), ("hidden", _p), ("cos", _p), ("sin", _p), ("slots", _p), ("blocks", _p),
                ("blocks_per_row", _i64), ("block_size", _i64), ("ctx", _i64), ("shared_blocks", _p),
                ("shared_tokens", _i64), ("layer", ctypes.POINTER(Layer)), ("work", _p), ("q8_rows", _p),
                ("q8_scales", _p), ("q4_sums", _p), ("q4_block_sums", _p), ("threads", _i32)]  # fmt: skip


STRUCTS = {"ts_matmul": Matmul, "ts_q4_matmul": Q4Matmul, "ts_attention": Attention, "ts_layer": Layer, "ts_decode_step": DecodeStep}


class _Field(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("offset", _i64), ("size", _i64)]


class _Number(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("value", _i64)]


def _describe(tensor: torch.Tensor) -> str:
    layout = "contiguous" if tensor.is_contiguous() else f"strides {tuple(tensor.stride())}"
    return f"{tensor.device.type} {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)} ({layout})"


def _address(
    kernel: str,
    name: str,
    tensor: torch.Tensor | None,
    dtypes: tuple[torch.dtype, ...],
    shape: tuple[int, ...] | None = None,
    at_least: int | None = None,
    optional: bool = False,
) -> int | None:
    """``tensor``'s data address once it is what ``kernel`` takes (a contiguous CPU tensor of one of
    ``dtypes``, of ``shape`` or of at least ``at_least`` elements); None for an ``optional`` one left out."""
    if tensor is None:
        if optional:
            return None
        raise KernelArgumentError(f"{kernel}: {name} is required")
    if (
        tensor.dtype in dtypes and tensor.is_cpu and tensor.is_contiguous()
        and (shape is None or tensor.shape == shape) and (at_least is None or tensor.numel() >= at_least)
    ):  # fmt: skip
        return tensor.data_ptr()
    wanted = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
    size = f" {list(shape)}" if shape is not None else "" if at_least is None else f" of at least {at_least} elements"
    raise KernelArgumentError(
        f"{kernel}: {name} must be a contiguous cpu {wanted} tensor{size}; got {_describe(tensor)}"
    )


def _dims(kernel: str, name: str, tensor: torch.Tensor, count: int) -> tuple[int, ...]:
    if tensor.dim() != count:
        raise KernelArgumentError(f"{kernel}: {name} must have {count} dimensions; got {_describe(tensor)}")
    return tuple(tensor.shape)


def _require(kernel: str, condition: bool, message: str) -> None:
    if not condition:
        raise KernelArgumentError(f"{kernel}: {message}")


@dataclass(frozen=True, slots=True)
class Projection:
    """A packed weight as the matmul kernels take it: its kind (``Q8_ROW``, ``Q8_GROUPED``, ``BF16``,
    ``F32``, ``Q4_0``, ``Q4_1``, ``Q5_0``, ``Q5_1``, ``Q4_K``, ``Q5_K``, ``Q6_K``), the packed weight, the q8
    scales (Q4/Q5: float16 scales, Q4_K and Q5_K
    its super-block bytes; Q6_K: int8 scales per 16), the bias (float32, or None) and, Q4_1 and Q4_K, the minimums (Q6_K: each
    row's float32 d per super-block)."""

    kind: int
    weight: torch.Tensor
    scale: torch.Tensor | None
    bias: torch.Tensor | None
    mins: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class DecoderLayer:
    """One layer of a decode stack: norm weights (float32; ``q_norm``/``k_norm`` None where the model has
    none) and its four projections; ``qkv_tail``: the last rows of q/k/v where they are kept in another kind
    (``qkv`` then holds the rows before them)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection
    qkv_tail: Projection | None = None
    qkv_tail_rows: int = 0


@dataclass(frozen=True, slots=True)
class DecodeShape:
    """The sizes of a decoder that ``ts_decode_layers`` runs."""

    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int

    @property
    def widest(self) -> int:
        """The widest projection input: a row of the q8 scratch."""
        return max(self.hidden_size, self.heads * self.head_dim, self.intermediate_size)

    def work_floats(self, ctx: int) -> int:
        """Floats of ``ts_decode_layers``' work area per row over ``ctx`` positions (its layout: cpu_gemm.c)."""
        q_size, qkv_size = self.heads * self.head_dim, (self.heads + 2 * self.kv_heads) * self.head_dim
        wide = max(self.hidden_size, self.intermediate_size)
        bf16_rows = (self.widest + 15) // 16 * 8  # a bfloat16 projection's rounded input row, in floats
        return (
            wide + qkv_size + 2 * q_size + self.hidden_size + 2 * self.intermediate_size + bf16_rows
            + q_size + 2 * self.heads  # a shared prefix's part of the attention and both parts' log-sum-exps
            + self.heads * ctx  # attention scores
        )  # fmt: skip


Q4_SCALE_DTYPES = {Q4_0: (torch.float16,), Q4_1: (torch.float16,), Q4_K: (torch.uint8,), Q5_0: (torch.float16,),
                   Q5_1: (torch.float16,), Q5_K: (torch.uint8,)}  # fmt: skip
WITH_MINS = (Q4_1, Q4_K, Q5_1, Q5_K)
Q4K_SUPER = 48  # bytes of a Q4_K tile's super-block scales (or minimums): 8 blocks x 4 rows of 6 bits, 4 float32


def q4_scale_shape(kind: int, tiles: int, blocks: int) -> tuple[int, ...]:
    """The shape of a Q4 weight's scales (and minimums): float16 per tile row and block, or Q4_K's bytes per
    super-block of 8 blocks (cpu_gemm.c's q4_k_scales)."""
    return (tiles, blocks // 8, Q4K_SUPER) if kind in (Q4_K, Q5_K) else (tiles, blocks, TILE)
WEIGHT_DTYPES = {Q8_ROW: torch.int8, Q8_GROUPED: torch.int8, BF16: torch.int16, F32: torch.float32,
                 Q4_0: torch.uint8, Q4_1: torch.uint8, Q4_K: torch.uint8, Q6_K: torch.uint8, Q5_0: torch.uint8,
                 Q5_1: torch.uint8, Q5_K: torch.uint8}  # fmt: skip


def _check_projection(kernels: Kernels, kernel: str, label: str, projection: Projection, n: int, k: int) -> tuple:
    """The addresses of ``projection``'s weight, scales and bias once each is what ``kernels`` takes for an
    ``[n, k]`` weight of its kind."""
    kind = projection.kind
    _require(kernel, kind in WEIGHT_DTYPES, f"{label}: unknown kind {kind!r}; allowed: {sorted(WEIGHT_DTYPES)}")
    _require(kernel, kind in (BF16, F32) or k % QK == 0, f"{label}: width {k} is not a multiple of {QK}")
    packed_shape = kernels.packed_shape(kind, n, k)
    weight = _address(kernel, f"{label} weight", projection.weight, (WEIGHT_DTYPES[kind],), packed_shape)
    scale = None
    if kind in Q4_SCALE_DTYPES:
        _require(kernel, kind not in (Q4_K, Q5_K) or k % (QK * 8) == 0, f"{label}: K-type width {k} is not a "
                 f"multiple of {QK * 8}")  # fmt: skip
        scale = _address(kernel, f"{label} scale", projection.scale, Q4_SCALE_DTYPES[kind],
                         q4_scale_shape(kind, *packed_shape[:2]))  # fmt: skip
    if kind == Q6_K:
        _require(kernel, k % (QK * Q6_SUPER) == 0, f"{label}: Q6_K width {k} is not a multiple of {QK * Q6_SUPER}")
        scale = _address(kernel, f"{label} scale", projection.scale, INT8, (*packed_shape[:2], 2, TILE))
    if kind in (Q8_ROW, Q8_GROUPED):
        scale_shape = kernels.q8_scale_shape(kind == Q8_GROUPED, n, k)
        scale = _address(kernel, f"{label} scale", projection.scale, FLOAT32, scale_shape)
    bias = _address(kernel, f"{label} bias", projection.bias, FLOAT32, (n,), optional=True)
    return weight, scale, bias


class MatmulWeight:
    """A packed weight checked once, for ``Kernels.matmul``: the tensors it points at are held here."""

    __slots__ = ("kernels", "projection", "kind", "out_features", "in_features", "weight", "scale", "bias",
                 "kernel", "function")  # fmt: skip

    def __init__(self, kernels: Kernels, projection: Projection, out_features: int, in_features: int) -> None:
        self.kernels, self.projection, self.kind = kernels, projection, projection.kind
        self.out_features, self.in_features = out_features, in_features
        self.kernel = {F32: "f32_gemm", BF16: "bf16_gemm"}.get(projection.kind, "q8_gemm")
        self.weight, self.scale, self.bias = _check_projection(
            kernels, self.kernel, "packed", projection, out_features, in_features
        )
        self.function = getattr(kernels._lib, f"ts_{self.kernel}")


class Kernels:
    """One loaded build of ``cpu_gemm.c``, checked against this module; each method runs one kernel on
    torch's thread count, writing into the ``out`` tensors it is given."""

    def __init__(self, path: Path, isa: str) -> None:
        self.path, self.isa = path, isa
        self._lib = lib = ctypes.CDLL(str(path))
        try:
            lib.ts_layout.argtypes = [ctypes.c_char_p, ctypes.POINTER(_i64), ctypes.POINTER(_i64)]
            lib.ts_layout.restype = ctypes.POINTER(_Field)
            lib.ts_constants.argtypes = [ctypes.POINTER(_i64)]
            lib.ts_constants.restype = ctypes.POINTER(_Number)
        except AttributeError as exc:
            raise KernelLoadError(f"{path}: not a build of this cpu_gemm.c ({exc}); rebuild: pip install -e .") from exc
        self._check(lib)
        self.avx512 = bool(self._constants(lib)["avx512"])
        for name, struct in (("ts_f32_gemm", Matmul), ("ts_bf16_gemm", Matmul), ("ts_q8_gemm", Matmul),
                             ("ts_q4_gemm", Q4Matmul), ("ts_q6k_gemm", Q4Matmul),
                             ("ts_decode_attention", Attention), ("ts_decode_layers", DecodeStep)):  # fmt: skip
            self._declare(name, [ctypes.POINTER(struct)])
        self._prefill = getattr(lib, "ts_prefill_attention", None)  # the AVX-512 build's
        if self._prefill is not None:
            self._declare("ts_prefill_attention", [ctypes.POINTER(Attention)])
        for name in ("ts_rms_norm", "ts_rms_norm_bf16"):
            self._declare(name, [_p, _i64, _i64, _p, _f32, _p])
        self._declare("ts_unit_rows", [_p, _i64, _i64, _p, _p, _i32])
        self._declare("ts_silu_mul", [_p, _i64, _i64, _p, _i32])
        self._declare("ts_silu_mul_bf16", [_p, _i64, _i64, _p, _i32])
        self._declare("ts_merge_attention", [_p, _p, _p, _p, _i64, _i64, _p, _i32])
        self._declare("ts_quantize_k", [_i32, _p, _p, _i64, _i64, _i32])
        self._lib.ts_quantize_k.restype = _i32

    def __repr__(self) -> str:
        return f"Kernels(isa={self.isa!r}, path={str(self.path)!r})"

    def _declare(self, name: str, argtypes: list) -> None:
        function = getattr(self._lib, name)
        function.argtypes, function.restype = argtypes, None

    @staticmethod
    def _constants(lib: ctypes.CDLL) -> dict[str, int]:
        count = _i64()
        numbers = lib.ts_constants(ctypes.byref(count))
        return {numbers[i].name.decode(): numbers[i].value for i in range(count.value)}

    def _check(self, lib: ctypes.CDLL) -> None:
        """The object's version, struct layouts and constants against this module's: KernelLoadError if not."""
        theirs = self._constants(lib)
        if theirs.get("version") != KERNEL_VERSION:
            raise KernelLoadError(
                f"{self.path} holds kernel version {theirs.get('version')}, this tierserve binds version "
                f"{KERNEL_VERSION}: rebuild the kernels (pip install -e . in a checkout, else reinstall tierserve)"
            )
        differing = {name: (theirs.get(name), value) for name, value in CONSTANTS.items() if theirs.get(name) != value}
        if differing:
            raise KernelLoadError(f"{self.path}: constants differ from cpu_gemm_abi's (object, binding): {differing}")
        for c_name, struct in STRUCTS.items():
            count, size = _i64(), _i64()
            fields = lib.ts_layout(c_name.encode(), ctypes.byref(count), ctypes.byref(size))
            if not fields:
                raise KernelLoadError(f"{self.path} does not describe {c_name}")
            c_side = [(fields[i].name.decode(), fields[i].offset, fields[i].size) for i in range(count.value)]
            ours = [(name, getattr(struct, name).offset, getattr(struct, name).size) for name, _ in struct._fields_]
            if c_side != ours or size.value != ctypes.sizeof(struct):
                raise KernelLoadError(
                    f"{c_name}: cpu_gemm.c declares {c_side} ({size.value} bytes), cpu_gemm_abi.{struct.__name__} "
                    f"{ours} ({ctypes.sizeof(struct)} bytes): make them agree"
                )

    @property
    def has_prefill_attention(self) -> bool:
        """Whether this build has ``prefill_attention`` (the AVX-512 build)."""
        return self._prefill is not None

    def packed_shape(self, kind: int, out_features: int, in_features: int) -> tuple[int, ...]:
        """The shape of a weight ``[out_features, in_features]`` packed for ``kind`` on this build."""
        n, k = out_features, in_features
        if kind in (Q8_ROW, Q8_GROUPED):
            return (-(-n // TILE), k // QK, TILE, QK)
        if kind == BF16:
            return (-(-n // PANEL), k // 2, PANEL, 2) if self.avx512 else (-(-n // TILE), k // 8, TILE, 8)
        if kind == F32:
            return (-(-n // PANEL), k, PANEL)
        if kind in (Q4_0, Q4_1, Q4_K):
            return (-(-n // TILE), k // QK, TILE, QK // 2)
        if kind in (Q5_0, Q5_1, Q5_K):
            return (-(-n // TILE), k // QK, Q5_BLOCK)
        if kind == Q6_K:
            return (-(-n // TILE), k // QK, Q6_BLOCK)
        raise KernelArgumentError(f"unknown projection kind {kind!r}; allowed: {sorted(WEIGHT_DTYPES)}")

    def q8_scale_shape(self, grouped: bool, out_features: int, in_features: int) -> tuple[int, ...]:
        """The shape of a q8 weight's scales: one per row, or per 32 columns in the weight's tiles."""
        tiles = -(-out_features // TILE)
        return (tiles, in_features // QK, TILE) if grouped else (tiles * TILE,)

    def matmul_weight(self, projection: Projection, out_features: int, in_features: int) -> MatmulWeight:
        """``projection`` checked once (dtype, packed shape, scales, bias) for ``matmul`` calls."""
        return MatmulWeight(self, projection, out_features, in_features)

    def matmul(
        self,
        weight: MatmulWeight,
        x: torch.Tensor,
        out: torch.Tensor,
        *,
        bf16_rows: torch.Tensor | None = None,
        q8_rows: torch.Tensor | None = None,
        q8_scales: torch.Tensor | None = None,
    ) -> None:
        """``out [M, N] = x [M, K] @ W.T (+ bias)`` on ``weight``'s kernel. ``x`` and ``out`` are float32; on
        the AVX-512 build a ``BF16`` weight also takes bfloat16 ``x`` and ``out``, and float32 ``x`` needs
        ``bf16_rows`` (int16, ``M * K``) to round it into. q8 weights round ``x`` to Q8_0 blocks into
        ``q8_rows`` (int8 ``[M, K]``) and ``q8_scales`` (float32 ``[M, K/32]``)."""
        kernel, kind = weight.kernel, weight.kind
        if weight.kernels is not self:
            raise KernelArgumentError(f"{kernel}: the weight was checked for {weight.kernels!r}, not {self!r}")
        rows = _dims(kernel, "x", x, 2)[0]
        k, n = weight.in_features, weight.out_features
        args = Matmul(
            rows=rows, in_features=k, weight=weight.weight, scale=weight.scale, grouped=int(kind == Q8_GROUPED),
            bias=weight.bias, out_features=n, threads=torch.get_num_threads(),
        )  # fmt: skip
        io = FLOATS if kind == BF16 and self.avx512 else FLOAT32
        args.x = _address(kernel, "x", x, io, (rows, k))
        args.out = _address(kernel, "out", out, io, (rows, n))
        if kind == BF16:
            x_bf16 = x.dtype == torch.bfloat16
            args.io = int(x_bf16) | int(out.dtype == torch.bfloat16) << 1
            scratch = self.avx512 and not x_bf16 and rows > 0
            args.bf16_rows = _address(kernel, "bf16_rows", bf16_rows, INT16, at_least=rows * k, optional=not scratch)
        elif kind != F32:
            args.q8_rows = _address(kernel, "q8_rows", q8_rows, INT8, (rows, k))
            args.q8_scales = _address(kernel, "q8_scales", q8_scales, FLOAT32, (rows, k // QK))
        weight.function(ctypes.byref(args))

    def q4_matmul(
        self,
        nibbles: torch.Tensor,
        scale: torch.Tensor,
        mins: torch.Tensor | None,
        bias: torch.Tensor | None,
        x: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """``out [M, N] = x [M, K] @ W.T (+ bias)`` for a Q4_0 or Q5_0 (``mins`` None), Q4_1, Q5_1, Q4_K or Q5_K
        weight in ``ts_q4_gemm``'s layout: ``nibbles`` uint8 ``[ceil(N/4), K/32, 4, 16]`` (Q5 types:
        ``[ceil(N/4), K/32, 80]``, the fifth bits after each block's nibbles), ``scale`` and ``mins``
        ``[ceil(N/4), K/32, 4]`` float16, or the K types' uint8 ``[ceil(N/4), K/256, 48]`` (cpu_gemm.c);
        ``x`` and ``out`` float32. The activations' Q8_0 scratch is allocated here."""
        kernel = "q4_gemm"
        high = nibbles.dim() == 3  # the Q5 types' tiles: 64 bytes of nibbles then 16 of fifth bits a block
        tiles, blocks = _dims(kernel, "nibbles", nibbles, 3 if high else 4)[:2]
        rows, k = _dims(kernel, "x", x, 2)
        n = _dims(kernel, "out", out, 2)[1]
        _require(kernel, k == blocks * QK and -(-n // TILE) == tiles, f"x {list(x.shape)} and out {list(out.shape)} "
                 f"do not fit a weight of {tiles} tiles of {TILE} rows and {blocks} blocks of {QK}")  # fmt: skip
        args = Q4Matmul(rows=rows, in_features=k, out_features=n, threads=torch.get_num_threads())
        shape = (tiles, blocks, Q5_BLOCK) if high else (tiles, blocks, TILE, QK // 2)
        args.nibbles = _address(kernel, "nibbles", nibbles, UINT8, shape)
        kind = Q4_K if scale.dtype == torch.uint8 else Q4_0
        _require(kernel, kind != Q4_K or blocks % 8 == 0, f"Q4_K: {blocks} blocks are not whole super-blocks of 8")
        args.k_scales, args.high_bits = int(kind == Q4_K), int(high)
        args.scale = _address(kernel, "scale", scale, (torch.float16, torch.uint8), q4_scale_shape(kind, tiles, blocks))
        args.mins = _address(kernel, "mins", mins, (scale.dtype,), q4_scale_shape(kind, tiles, blocks), optional=True)
        args.bias = _address(kernel, "bias", bias, FLOAT32, (n,), optional=True)
        args.x = _address(kernel, "x", x, FLOAT32, (rows, k))
        args.out = _address(kernel, "out", out, FLOAT32, (rows, n))
        scratch = [torch.empty(rows, k, dtype=torch.int8), torch.empty(rows, blocks), torch.empty(rows, blocks, TILE,
                   dtype=torch.int32), torch.empty(rows, blocks)]  # fmt: skip
        args.q8_rows, args.q8_scales, args.q8_sums, args.q8_block_sums = (t.data_ptr() for t in scratch)
        self._lib.ts_q4_gemm(ctypes.byref(args))

    def q6k_matmul(
        self,
        bits: torch.Tensor,
        scales: torch.Tensor,
        d: torch.Tensor,
        bias: torch.Tensor | None,
        x: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """``out [M, N] = x [M, K] @ W.T (+ bias)`` for a Q6_K weight in ``ts_q6k_gemm``'s layout: ``bits`` uint8
        ``[ceil(N/4), K/32, 96]``, ``scales`` int8 ``[ceil(N/4), K/32, 2, 4]``, ``d`` float32
        ``[ceil(N/4), K/256, 4]``; ``x`` and ``out`` float32. The activations' Q8_0 scratch is allocated here."""
        kernel = "q6k_gemm"
        tiles, blocks = _dims(kernel, "bits", bits, 3)[:2]
        rows, k = _dims(kernel, "x", x, 2)
        n = _dims(kernel, "out", out, 2)[1]
        _require(kernel, k == blocks * QK and -(-n // TILE) == tiles and blocks % Q6_SUPER == 0,
                 f"x {list(x.shape)} and out {list(out.shape)} do not fit a weight of {tiles} tiles of {TILE} rows "
                 f"and {blocks} blocks of {QK} (whole super-blocks of {Q6_SUPER})")  # fmt: skip
        args = Q4Matmul(rows=rows, in_features=k, out_features=n, threads=torch.get_num_threads())
        args.nibbles = _address(kernel, "bits", bits, UINT8, (tiles, blocks, Q6_BLOCK))
        args.scale = _address(kernel, "scales", scales, INT8, (tiles, blocks, 2, TILE))
        args.mins = _address(kernel, "d", d, FLOAT32, (tiles, blocks // Q6_SUPER, TILE))
        args.bias = _address(kernel, "bias", bias, FLOAT32, (n,), optional=True)
        args.x = _address(kernel, "x", x, FLOAT32, (rows, k))
        args.out = _address(kernel, "out", out, FLOAT32, (rows, n))
        scratch = [torch.empty(rows, k, dtype=torch.int8), torch.empty(rows, blocks)]
        args.q8_rows, args.q8_scales = (t.data_ptr() for t in scratch)
        self._lib.ts_q6k_gemm(ctypes.byref(args))

    def _attention(
        self,
        kernel: str,
        q: torch.Tensor,
        batch: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        blocks: torch.Tensor,
        block_size: int,
        ctx: int,
        keep: torch.Tensor | None,
        scale: float,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        bf16_queries: bool,
    ) -> Attention:
        rows, heads, head_dim = _dims(kernel, "q", q, 3)
        slots, kv_heads, kv_dim = _dims(kernel, "k_cache", k_cache, 3)
        _require(kernel, kv_dim == head_dim, f"k_cache's head_dim {kv_dim} is not q's {head_dim}")
        _require(kernel, heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP,
                 f"{heads} query heads over {kv_heads} KV heads: at most {MAX_GROUP} per KV head, evenly")  # fmt: skip
        _require(kernel, batch > 0 and rows % batch == 0, f"q's {rows} rows are not {batch} sequences' rows")
        nb = _dims(kernel, "blocks", blocks, 2)[1]
        _require(kernel, nb * block_size >= ctx, f"{nb} blocks of {block_size} hold fewer than ctx = {ctx} positions")
        return Attention(
            q=_address(kernel, "q", q, FLOAT32), batch=batch, q_len=rows // batch, heads=heads,
            kv_heads=kv_heads, head_dim=head_dim, k=_address(kernel, "k_cache", k_cache, FLOATS),
            v=_address(kernel, "v_cache", v_cache, (k_cache.dtype,), (slots, kv_heads, head_dim)),
            flags=int(k_cache.dtype == torch.bfloat16) | int(bf16_queries) << 1,
            blocks=_address(kernel, "blocks", blocks, INT64, (batch, nb)), blocks_per_row=nb,
            block_size=block_size, ctx=ctx, keep=_address(kernel, "keep", keep, UINT8, (rows, ctx), optional=True),
            scale=scale, out=_address(kernel, "out", out, FLOAT32, (rows, heads, head_dim)),
            lse=_address(kernel, "lse", lse, FLOAT32, (rows, heads), optional=True), threads=torch.get_num_threads(),
        )  # fmt: skip

    def decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        blocks: torch.Tensor,
        block_size: int,
        ctx: int,
        keep: torch.Tensor | None,
        scale: float,
        out: torch.Tensor,
        scores: torch.Tensor,
        lse: torch.Tensor | None = None,
        bf16_queries: bool = False,
    ) -> None:
        """One query token per sequence (``q: [batch, heads, head_dim]`` float32) against the arena
        (``[slots, kv_heads, head_dim]``, float32 or bfloat16) through ``blocks [batch, n]`` (int64); ``keep``
        (uint8 ``[batch, ctx]``) selects positions; ``scores`` is float32 scratch of ``batch * heads * ctx``;
        ``lse`` (``[batch, heads]``) gets each row's log-sum-exp. ``bf16_queries``: ``q`` holds bfloat16
        values, which the AVX-512 build multiplies exactly with vdpbf16ps."""
        kernel = "decode_attention"
        _require(kernel, q.dim() == 3 and q.shape[-1] % 8 == 0, f"q must be [batch, heads, head_dim], head_dim a "
                 f"multiple of 8; got {_describe(q)}")  # fmt: skip
        args = self._attention(kernel, q, q.shape[0], k_cache, v_cache, blocks, block_size, ctx, keep, scale, out,
                               lse, bf16_queries)  # fmt: skip
        args.scores = _address(kernel, "scores", scores, FLOAT32, at_least=q.shape[0] * q.shape[1] * ctx)
        self._lib.ts_decode_attention(ctypes.byref(args))

    def prefill_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        blocks: torch.Tensor,
        block_size: int,
        ctx: int,
        keep: torch.Tensor | None,
        scale: float,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
        causal: bool = True,
        bf16_queries: bool = False,
    ) -> None:
        """``q_len`` query tokens for each of ``blocks.shape[0]`` sequences (``q: [batch * q_len, heads,
        head_dim]`` float32, sequence by sequence) against the arena; ``keep`` (uint8 ``[batch * q_len, ctx]``)
        selects positions, else ``causal`` places the queries last among ``ctx`` (or lets them see all).
        The AVX-512 build only (``has_prefill_attention``)."""
        kernel = "prefill_attention"
        if self._prefill is None:
            raise KernelArgumentError(f"{kernel}: the {self.isa} build has no prefill attention kernel")
        args = self._attention(kernel, q, blocks.shape[0], k_cache, v_cache, blocks, block_size, ctx, keep, scale,
                               out, lse, bf16_queries)  # fmt: skip
        args.causal = int(causal)
        self._prefill(ctypes.byref(args))

    def merge_attention(
        self, a: torch.Tensor, lse_a: torch.Tensor, b: torch.Tensor, lse_b: torch.Tensor, out: torch.Tensor
    ) -> None:
        """``out`` = two attention results ``[rows, heads, head_dim]`` over disjoint positions merged by
        their log-sum-exps ``[rows, heads]``, all float32."""
        kernel = "merge_attention"
        shape = _dims(kernel, "a", a, 3)
        self._lib.ts_merge_attention(
            _address(kernel, "a", a, FLOAT32), _address(kernel, "lse_a", lse_a, FLOAT32, shape[:2]),
            _address(kernel, "b", b, FLOAT32, shape), _address(kernel, "lse_b", lse_b, FLOAT32, shape[:2]),
            shape[0] * shape[1], shape[2], _address(kernel, "out", out, FLOAT32, shape), torch.get_num_threads(),
        )  # fmt: skip

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor, bf16: bool = False
    ) -> None:
        """Hugging Face's RMSNorm of float32 rows ``x [..., H]`` by ``weight [H]`` into ``out`` (x's shape), on
        one thread; ``bf16``: ``x`` and ``weight`` hold bfloat16 values and each step rounds as bfloat16 does."""
        kernel = "rms_norm"
        _require(kernel, x.dim() >= 1, f"x must have rows; got {_describe(x)}")
        width = x.shape[-1]
        function = self._lib.ts_rms_norm_bf16 if bf16 else self._lib.ts_rms_norm
        function(
            _address(kernel, "x", x, FLOAT32), x.numel() // max(width, 1), width,
            _address(kernel, "weight", weight, FLOAT32, (width,)), eps,
            _address(kernel, "out", out, FLOAT32, tuple(x.shape)),
        )  # fmt: skip

    def unit_rows(self, x: torch.Tensor, out: torch.Tensor, norms: torch.Tensor) -> None:
        """Float32 rows ``x [M, K]`` each over its largest |x| into ``out [M + 1, K]`` (last row (1, -1, 0...)),
        the divisors into ``norms [M, 1]``."""
        kernel = "unit_rows"
        m, k = _dims(kernel, "x", x, 2)
        self._lib.ts_unit_rows(
            _address(kernel, "x", x, FLOAT32), m, k, _address(kernel, "out", out, FLOAT32, (m + 1, k)),
            _address(kernel, "norms", norms, FLOAT32, (m, 1)), torch.get_num_threads(),
        )  # fmt: skip

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> None:
        """``out [M, I] = silu(gate) * up`` of ``gate_up [M, 2I]`` (gate first), float32 or bfloat16 (both
        tensors the same dtype)."""
        kernel = "silu_mul"
        m, width = _dims(kernel, "gate_up", gate_up, 2)
        _require(kernel, width % 2 == 0, f"gate_up's width {width} is odd")
        dtype = gate_up.dtype
        function = self._lib.ts_silu_mul_bf16 if dtype == torch.bfloat16 else self._lib.ts_silu_mul
        function(
            _address(kernel, "gate_up", gate_up, FLOATS), m, width // 2,
            _address(kernel, "out", out, (dtype,), (m, width // 2)), torch.get_num_threads(),
        )  # fmt: skip

    def quantize_k(self, kind: str, x: torch.Tensor) -> torch.Tensor:
        """Float32 rows ``x [M, K]`` (K whole super-blocks of 256) in GGUF blocks of ``kind`` (``Q4_K``, ``Q5_K``
        or ``Q6_K``), uint8 ``[M, K / 256, bytes a super-block]``: the bytes llama.cpp's reference quantizer
        (``quantize_row_q4_K_ref`` ...) writes, as ``llama-quantize`` does without an importance matrix."""
        kernel = "quantize_k"
        m, k = _dims(kernel, "x", x, 2)
        _require(kernel, kind in K_SUPER_BLOCK_BYTES, f"kind must be one of {', '.join(K_SUPER_BLOCK_BYTES)}; got {kind!r}")
        _require(kernel, k % QK_K == 0, f"x's width {k} is not whole super-blocks of {QK_K}")
        out = torch.empty(m, k // QK_K, K_SUPER_BLOCK_BYTES[kind], dtype=torch.uint8)
        code = self._lib.ts_quantize_k(
            int(kind[1]), _address(kernel, "x", x, FLOAT32), out.data_ptr(), m, k, torch.get_num_threads()
        )
        _require(kernel, code == 0, f"ts_quantize_k refused {kind} [{m}, {k}]")
        return out

    def decode_stack(self, shape: DecodeShape, layers: Sequence[DecoderLayer], act_bf16: bool) -> DecodeStack:
        """The ``ts_layer`` table of a decoder's layers, each weight checked against ``shape``."""
        return DecodeStack(self, shape, layers, act_bf16)


class DecodeStack:
    """A decoder's layers as ``ts_decode_layers`` reads them: one ``ts_layer`` per layer, holding the tensors
    it points at. The arena is set when it is (re)allocated, the positions each step."""

    def __init__(self, kernels: Kernels, shape: DecodeShape, layers: Sequence[DecoderLayer], act_bf16: bool) -> None:
        self.kernels, self.shape, self.act_bf16 = kernels, shape, act_bf16
        self.table = (Layer * len(layers))()
        self.kv_dtype: torch.dtype | None = None
        self._held: list[torch.Tensor] = []
        self._q4_scratch = (torch.empty(0, dtype=torch.int32), torch.empty(0))
        s = shape
        q_size, qkv_size = s.heads * s.head_dim, (s.heads + 2 * s.kv_heads) * s.head_dim
        projections = {  # [out_features, in_features]
            "qkv": (qkv_size, s.hidden_size), "o": (s.hidden_size, q_size),
            "gate_up": (2 * s.intermediate_size, s.hidden_size), "down": (s.hidden_size, s.intermediate_size),
        }  # fmt: skip
        kernel = "decode_stack"
        for index, (entry, layer) in enumerate(zip(self.table, layers)):
            where = f"layer {index}"
            entry.input_norm = self._hold(kernel, f"{where} input_norm", layer.input_norm, (s.hidden_size,))
            entry.post_norm = self._hold(kernel, f"{where} post_norm", layer.post_norm, (s.hidden_size,))
            entry.q_norm = self._hold(kernel, f"{where} q_norm", layer.q_norm, (s.head_dim,), optional=True)
            entry.k_norm = self._hold(kernel, f"{where} k_norm", layer.k_norm, (s.head_dim,), optional=True)
            tail = layer.qkv_tail
            if tail is not None:
                tail_rows = layer.qkv_tail_rows
                # the parts are computed into the gate/up area, then joined
                _require(kernel, 0 < tail_rows < qkv_size and qkv_size - tail_rows <= 2 * s.intermediate_size,
                         f"{where} qkv_tail: {tail_rows} rows do not split {qkv_size} (parts of at most "
                         f"{2 * s.intermediate_size})")  # fmt: skip
                self._set_projection(kernels, entry, f"{where} qkv_tail", "qkv_tail", tail, tail_rows, s.hidden_size)
                entry.qkv_tail_rows = tail_rows
            for name, (n, k) in projections.items():
                if name == "qkv" and tail is not None:
                    n -= entry.qkv_tail_rows
                projection: Projection = getattr(layer, name)
                # ts_decode_layers adds the bias of qkv and o only
                _require(kernel, name in ("qkv", "o") or projection.bias is None, f"{where} {name}: a bias it would "
                         "not add")  # fmt: skip
                self._set_projection(kernels, entry, f"{where} {name}", name, projection, n, k)

    def _set_projection(self, kernels: Kernels, entry: Layer, label: str, name: str, projection: Projection, n: int,
                        k: int) -> None:  # fmt: skip
        """``entry``'s fields ``{name}_weight``, ``_scale``, ``_bias``, ``_kind`` and ``_mins`` for ``projection``
        (an ``[n, k]`` weight), checked; the tensors held."""
        kernel = "decode_stack"
        weight, scale, bias = _check_projection(kernels, kernel, label, projection, n, k)
        setattr(entry, f"{name}_weight", weight)
        setattr(entry, f"{name}_scale", scale)
        if name in ("qkv", "o", "qkv_tail"):
            setattr(entry, f"{name}_bias", bias)
        setattr(entry, f"{name}_kind", projection.kind)
        if projection.kind in WITH_MINS:
            setattr(entry, f"{name}_mins", _address(kernel, f"{label} mins", projection.mins,
                                                    Q4_SCALE_DTYPES[projection.kind],
                                                    tuple(projection.scale.shape)))  # fmt: skip
        if projection.kind == Q6_K:
            tiles, blocks = projection.weight.shape[:2]
            setattr(entry, f"{name}_mins", _address(kernel, f"{label} d", projection.mins, FLOAT32,
                                                    (tiles, blocks // Q6_SUPER, TILE)))  # fmt: skip
        self._held += [t for t in (projection.weight, projection.scale, projection.bias, projection.mins)
                       if t is not None]  # fmt: skip

    def _hold(
        self, kernel: str, name: str, tensor: torch.Tensor | None, shape: tuple[int, ...], optional: bool = False
    ) -> int | None:
        address = _address(kernel, name, tensor, FLOAT32, shape, optional=optional)
        if tensor is not None:
            self._held.append(tensor)
        return address

    def set_arena(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """Each layer's arena (``[slots, kv_heads, head_dim]``, float32 or bfloat16, keys and values alike)."""
        kernel, s = "decode_stack", self.shape
        _require(kernel, len(keys) == len(values) == len(self.table), f"{len(keys)} key and {len(values)} value "
                 f"arenas for {len(self.table)} layers")  # fmt: skip
        dtype = keys[0].dtype
        _require(kernel, dtype in FLOATS, f"the arena must be float32 or bfloat16, not {dtype}")
        for index, (entry, k, v) in enumerate(zip(self.table, keys, values)):
            shape = (_dims(kernel, f"layer {index} keys", k, 3)[0], s.kv_heads, s.head_dim)
            entry.k_cache = _address(kernel, f"layer {index} keys", k, (dtype,), shape)
            entry.v_cache = _address(kernel, f"layer {index} values", v, (dtype,), shape)
        self.kv_dtype = dtype

    def run(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        blocks: torch.Tensor,
        block_size: int,
        ctx: int,
        keeps: Sequence[torch.Tensor | None],
        eps: float,
        scale: float,
        work: torch.Tensor,
        q8_rows: torch.Tensor,
        q8_scales: torch.Tensor,
        shared_blocks: torch.Tensor | None = None,
        shared_tokens: int = 0,
    ) -> None:
        """One decode step of ``hidden``'s rows through every layer (``hidden [rows, hidden_size]`` float32,
        updated in place; ``cos``/``sin [rows, head_dim]``; ``slots [rows]`` and ``blocks [rows, n]`` int64;
        ``keeps``: each layer's uint8 ``[rows, ctx]`` positions or None); ``work``, ``q8_rows`` and
        ``q8_scales`` are scratch of at least ``rows * shape.work_floats(ctx)`` floats, ``rows *
        shape.widest`` int8 and that over 32 floats. ``shared_blocks`` (the AVX-512 build): a prefix of
        ``shared_tokens`` positions every row shares, read once."""
        kernel, s = "decode_layers", self.shape
        _require(kernel, self.kv_dtype is not None, "no arena set (set_arena)")
        rows = _dims(kernel, "hidden", hidden, 2)[0]
        blocks_wide = rows * s.widest // QK  # the Q4 projections' sums: held here, grown when a step has more rows
        if self._q4_scratch[1].numel() < max(1, blocks_wide):
            self._q4_scratch = (torch.empty(max(1, blocks_wide) * 4, dtype=torch.int32), torch.empty(max(1, blocks_wide)))
        nb = _dims(kernel, "blocks", blocks, 2)[1]
        _require(kernel, nb * block_size >= ctx, f"{nb} blocks of {block_size} hold fewer than ctx = {ctx} positions")
        _require(kernel, len(keeps) == len(self.table), f"{len(keeps)} keeps for {len(self.table)} layers")
        _require(kernel, shared_blocks is None or self.kernels.has_prefill_attention,
                 f"the {self.kernels.isa} build reads no shared prefix")  # fmt: skip
        checked: dict[int, int | None] = {}
        for entry, keep in zip(self.table, keeps):  # a few distinct masks (one per window) for many layers
            if id(keep) not in checked:
                checked[id(keep)] = _address(kernel, "keep", keep, UINT8, (rows, ctx), optional=True)
            entry.keep = checked[id(keep)]
        shared = None
        if shared_blocks is not None:
            _require(kernel, _dims(kernel, "shared_blocks", shared_blocks, 1)[0] * block_size >= shared_tokens,
                     f"shared_blocks hold fewer than shared_tokens = {shared_tokens} positions")  # fmt: skip
            shared = _address(kernel, "shared_blocks", shared_blocks, INT64)
        self.kernels._lib.ts_decode_layers(ctypes.byref(DecodeStep(
            rows=rows, layers=len(self.table), hidden_size=s.hidden_size, heads=s.heads, kv_heads=s.kv_heads,
            head_dim=s.head_dim, intermediate_size=s.intermediate_size, eps=eps, scale=scale,
            act_bf16=int(self.act_bf16), kv_bf16=int(self.kv_dtype == torch.bfloat16),
            hidden=_address(kernel, "hidden", hidden, FLOAT32, (rows, s.hidden_size)),
            cos=_address(kernel, "cos", cos, FLOAT32, (rows, s.head_dim)),
            sin=_address(kernel, "sin", sin, FLOAT32, (rows, s.head_dim)),
            slots=_address(kernel, "slots", slots, INT64, (rows,)),
            blocks=_address(kernel, "blocks", blocks, INT64, (rows, nb)), blocks_per_row=nb,
            block_size=block_size, ctx=ctx, shared_blocks=shared, shared_tokens=shared_tokens if shared else 0,
            layer=self.table, work=_address(kernel, "work", work, FLOAT32, at_least=rows * s.work_floats(ctx)),
            q8_rows=_address(kernel, "q8_rows", q8_rows, INT8, at_least=rows * s.widest),
            q8_scales=_address(kernel, "q8_scales", q8_scales, FLOAT32, at_least=rows * s.widest // QK),
            q4_sums=self._q4_scratch[0].data_ptr(), q4_block_sums=self._q4_scratch[1].data_ptr(),
            threads=torch.get_num_threads(),
        )))  # fmt: skip
