"""A GGUF file read once: header, metadata and tensor directory parsed with ``struct``, tensor data memory-mapped.

llama.cpp's Python reader (``gguf.GGUFReader``) builds a numpy view per metadata value: on a real model's
49,152-token vocabulary and 48,900 merges that is seconds per open, and loading used to open a file three times
(check, config, tokenizer). This reader walks the same layout (GGUF v2/v3, little-endian) in one pass over the
header bytes and keeps every value as a Python object; tensor bytes stay in the file and are handed out as
read-only ``numpy.memmap`` views shaped as ``gguf.GGUFReader`` shapes them, so its dequantizers apply unchanged.
Every length and offset is checked against the file's size before it is used: a truncated or corrupt file raises
``GGUFFormatError`` naming the byte where it went wrong, never reads past the end or allocates a bogus size.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_SCALARS: dict[int, struct.Struct] = {
    UINT8: struct.Struct("<B"), INT8: struct.Struct("<b"), UINT16: struct.Struct("<H"), INT16: struct.Struct("<h"),
    UINT32: struct.Struct("<I"), INT32: struct.Struct("<i"), FLOAT32: struct.Struct("<f"), BOOL: struct.Struct("<?"),
    UINT64: struct.Struct("<Q"), INT64: struct.Struct("<q"), FLOAT64: struct.Struct("<d"),
}  # fmt: skip
_NUMPY: dict[int, str] = {
    UINT8: "<u1", INT8: "<i1", UINT16: "<u2", INT16: "<i2", UINT32: "<u4", INT32: "<i4", FLOAT32: "<f4",
    BOOL: "?", UINT64: "<u8", INT64: "<i8", FLOAT64: "<f8",
}  # fmt: skip
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")

# GGML tensor types -> (elements per block, bytes per block); llama.cpp's ggml.h / gguf-py's GGML_QUANT_SIZES
BLOCK_SIZES: dict[int, tuple[int, int]] = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 36),
    10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
    16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82),
    23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2),
    34: (256, 54), 35: (256, 66), 39: (32, 17),
}  # fmt: skip
# element dtypes of the unquantized types (F32, F16, I8, I16, I32, I64, F64); every other type is bytes (uint8)
_ELEMENT_DTYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader can walk: bad magic or version, or truncated or corrupt."""


@dataclass(frozen=True, slots=True)
class GGUFValue:
    """One metadata value: the Python value and its GGUF type (``item_type`` for arrays)."""

    value: Any
    value_type: int
    item_type: int | None = None


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor's directory entry: ``shape`` in GGUF's order (innermost first), ``offset`` absolute in the file."""

    name: str
    tensor_type: int
    shape: tuple[int, ...]
    offset: int
    n_elements: int
    n_bytes: int


class GGUFFile:
    """A parsed GGUF file: ``fields`` (key -> ``GGUFValue``), ``tensors`` (in file order), ``data(tensor)``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as handle:
            self.size = self.path.stat().st_size
            if self.size < 24:
                raise GGUFFormatError(f"{self.size} bytes is too short for a GGUF header")
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        self.fields: dict[str, GGUFValue] = {}
        self.tensors: list[GGUFTensor] = []
        self._parse()

    def close(self) -> None:
        self._map.close()

    def value(self, key: str, default: Any = None) -> Any:
        """The Python value of metadata ``key`` (a list for arrays), or ``default``."""
        field = self.fields.get(key)
        return default if field is None else field.value

    def data(self, tensor: GGUFTensor) -> np.ndarray:
        """``tensor``'s bytes as a read-only memory-mapped array, shaped as ``gguf.GGUFReader`` shapes it:
        unquantized types as their elements (outermost dimension first), block types as uint8 rows of blocks."""
        dims = tuple(reversed(tensor.shape))
        dtype = _ELEMENT_DTYPES.get(tensor.tensor_type)
        if dtype is not None:
            return np.frombuffer(self._map, dtype=dtype, count=tensor.n_elements, offset=tensor.offset).reshape(dims)
        block, block_bytes = BLOCK_SIZES[tensor.tensor_type]
        row_bytes = tensor.shape[0] // block * block_bytes if tensor.shape else tensor.n_bytes
        flat = np.frombuffer(self._map, dtype=np.uint8, count=tensor.n_bytes, offset=tensor.offset)
        return flat.reshape(*dims[:-1], row_bytes) if dims else flat

    # -- parsing ---------------------------------------------------------------------------------------------

    def _need(self, count: int, what: str) -> int:
        start = self._pos
        if count < 0 or start + count > self.size:
            raise GGUFFormatError(f"{what} at byte {start} needs {count} bytes but the file ends at {self.size}")
        self._pos = start + count
        return start

    def _unpack(self, codec: struct.Struct, what: str) -> Any:
        return codec.unpack_from(self._map, self._need(codec.size, what))[0]

    def _string(self, what: str) -> str:
        length = self._unpack(_U64, what)
        start = self._need(length, what)
        try:
            return self._map[start : start + length].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GGUFFormatError(f"{what} at byte {start} is not UTF-8 ({exc.reason})") from None

    def _value(self, value_type: int, what: str) -> Any:
        if value_type == STRING:
            return self._string(what)
        codec = _SCALARS.get(value_type)
        if codec is None:
            raise GGUFFormatError(f"{what}: unknown value type {value_type}")
        return self._unpack(codec, what)

    def _array(self, what: str) -> tuple[list[Any], int]:
        item_type = self._unpack(_U32, what)
        count = self._unpack(_U64, what)
        if item_type == STRING:
            # each string needs at least its 8-byte length: a count the rest of the file cannot hold is corrupt
            if count * 8 > self.size - self._pos:
                raise GGUFFormatError(f"{what}: {count} strings cannot fit in the {self.size - self._pos} bytes left")
            return [self._string(what) for _ in range(count)], item_type
        if item_type == ARRAY:
            return [self._array(what)[0] for _ in range(count)], item_type
        dtype = _NUMPY.get(item_type)
        if dtype is None:
            raise GGUFFormatError(f"{what}: unknown array item type {item_type}")
        width = np.dtype(dtype).itemsize
        start = self._need(count * width, what)
        return np.frombuffer(self._map, dtype=dtype, count=count, offset=start).tolist(), item_type

    def _parse(self) -> None:
        if self._map[:4] != MAGIC:
            raise GGUFFormatError(f"no GGUF magic at byte 0 (found {bytes(self._map[:4])!r})")
        self._pos = 4
        version = self._unpack(_U32, "version")
        if version not in (2, 3):
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            hint = " (a big-endian file: convert it on a little-endian machine)" if swapped in (2, 3) else ""
            raise GGUFFormatError(f"GGUF version {version} is not supported (2 and 3 are){hint}")
        tensor_count = self._unpack(_U64, "tensor count")
        kv_count = self._unpack(_U64, "metadata count")
        if tensor_count > self.size or kv_count > self.size:
            raise GGUFFormatError(f"{tensor_count} tensors and {kv_count} metadata entries cannot fit in the file")
        self.version = version
        for index in range(kv_count):
            key = self._string(f"metadata key {index}")
            value_type = self._unpack(_U32, f"type of {key!r}")
            if value_type == ARRAY:
                values, item_type = self._array(repr(key))
                self.fields[key] = GGUFValue(values, ARRAY, item_type)
            else:
                self.fields[key] = GGUFValue(self._value(value_type, repr(key)), value_type)
        directory = []
        for index in range(tensor_count):
            name = self._string(f"tensor name {index}")
            n_dims = self._unpack(_U32, f"dimensions of {name!r}")
            if n_dims > 8:
                raise GGUFFormatError(f"tensor {name!r} has {n_dims} dimensions (at most 8)")
            shape = tuple(self._unpack(_U64, f"shape of {name!r}") for _ in range(n_dims))
            tensor_type = self._unpack(_U32, f"type of {name!r}")
            offset = self._unpack(_U64, f"offset of {name!r}")
            directory.append((name, tensor_type, shape, offset))
        alignment = self.value("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"general.alignment = {alignment!r} is not a power of two")
        data_start = -(-self._pos // alignment) * alignment
        for name, tensor_type, shape, offset in directory:
            n_elements = 1
            for dim in shape:
                n_elements *= dim
            block, block_bytes = BLOCK_SIZES.get(tensor_type, (0, 0))
            if block == 0:
                raise GGUFFormatError(f"tensor {name!r} has unknown GGML type {tensor_type}")
            if shape and shape[0] % block:
                raise GGUFFormatError(f"tensor {name!r}: rows of {shape[0]} are not whole blocks of {block}")
            n_bytes = n_elements // block * block_bytes
            start = data_start + offset
            if start + n_bytes > self.size:
                raise GGUFFormatError(
                    f"tensor {name!r} ends at byte {start + n_bytes} but the file has {self.size} bytes"
                )
            self.tensors.append(GGUFTensor(name, tensor_type, shape, start, n_elements, n_bytes))
        self.data_start = data_start
