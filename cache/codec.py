"""The byte format of a ``CacheEntry`` at rest (the L3 disk tier): a checked header, then zstd.

Every field is little-endian; ``decode`` checks each one and raises
``CorruptEntryError`` (and nothing else) for any input it does not accept::

    +--------+---------------+-----------------------------------------------+
    | bytes  | type          | field                                         |
    +--------+---------------+-----------------------------------------------+
    | 4      | "TSKV"        | magic                                         |
    | 2      | u16           | format version (FORMAT_VERSION)               |
    | 2 + F  | u16 + utf-8   | model fingerprint                             |
    | 2 + K  | u16 + bytes   | key (the block hash)                          |
    | 2 + P  | u16 + bytes   | parent hash; P == 0 means no parent           |
    | 4 + 4T | u32 + i32[T]  | token ids                                     |
    | 1      | u8            | dtype code: 1 float32, 2 float16, 3 bfloat16  |
    | 1 + 8N | u8 + i64[N]   | shape                                         |
    | 8      | f64           | created (``time.time()``)                     |
    | 8      | u64           | raw length: tensor bytes before compression   |
    | 8      | u64           | compressed length: bytes after the header     |
    | 16     | blake2b-16    | checksum of every header byte above, then of  |
    |        |               | the compressed payload below                  |
    +--------+---------------+-----------------------------------------------+
    | C      | zstd frame    | the tensor's bytes, C-contiguous, in the host |
    |        |               | byte order (little-endian on every supported  |
    |        |               | host); bfloat16 is carried bit for bit        |
    +--------+---------------+-----------------------------------------------+

The checksum covers the header and every payload byte, so any flipped bit is
caught before decompression (a zstd frame has bits whose change would not alter
the decoded data, and the entry must still not pass as intact); the zstd
frame's own content checksum then guards the decompressed tensor.
"""

from __future__ import annotations

import hashlib
import math
import struct
import threading

import zstandard

from tierserve.cache.tier import CacheEntry

MAGIC = b"TSKV"
FORMAT_VERSION = 2

# By name, not torch.dtype: the disk tier imports this module in the HTTP process, which never loads torch.
_DTYPE_BY_CODE: dict[int, str] = {1: "float32", 2: "float16", 3: "bfloat16"}
_CODE_BY_DTYPE: dict[str, int] = {name: code for code, name in _DTYPE_BY_CODE.items()}
_ITEMSIZE: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}

_PREAMBLE = struct.Struct("<4sH")
_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_TRAILER = struct.Struct("<dQQ")  # created, raw length, compressed length
_CHECKSUM_SIZE = 16
_MAX_U16 = 0xFFFF


class CorruptEntryError(Exception):
    """Bytes that are not a valid entry of this model: damaged, truncated or foreign."""


class _Reader:
    """A cursor over the encoded bytes that turns running off the end into ``CorruptEntryError``."""

    __slots__ = ("data", "pos")

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int, what: str) -> memoryview:
        end = self.pos + n
        if end > len(self.data):
            raise CorruptEntryError(
                f"truncated in {what}: needs {n} bytes at offset {self.pos}, {len(self.data) - self.pos} left"
            )
        chunk = self.data[self.pos : end]
        self.pos = end
        return chunk

    def unpack(self, layout: struct.Struct, what: str) -> tuple:
        return layout.unpack(self.take(layout.size, what))

    def sized(self, what: str) -> memoryview:
        (length,) = self.unpack(_U16, what)
        return self.take(length, what)


class KVCodec:
    """Encodes ``CacheEntry`` values to the format above and checks them on the way back.

    Args:
        fingerprint: the model fingerprint written into every entry; ``decode``
            rejects entries written under another one as foreign.
        level: zstd compression level (1-22).

    One codec may be shared by threads: each thread gets its own zstd contexts.
    """

    def __init__(self, fingerprint: str, level: int = 3) -> None:
        self.fingerprint = fingerprint
        self.level = level
        self._fingerprint_bytes = fingerprint.encode()
        if len(self._fingerprint_bytes) > _MAX_U16:
            raise ValueError(f"fingerprint is {len(self._fingerprint_bytes)} bytes; at most {_MAX_U16} fit the format")
        self._local = threading.local()

    def encode(self, entry: CacheEntry) -> bytes:
        """The entry's bytes. Raises ``ValueError`` for an entry the format cannot hold
        (a dtype other than float32/float16/bfloat16, a token id outside int32, a key
        or parent longer than 65535 bytes)."""
        import torch

        kv = entry.kv.detach()
        code = _CODE_BY_DTYPE.get(str(kv.dtype).removeprefix("torch."))
        if code is None:
            supported = ", ".join(f"torch.{name}" for name in _CODE_BY_DTYPE)
            raise ValueError(f"cannot encode KV of dtype {kv.dtype}; supported: {supported}")
        raw = kv.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        parent = entry.parent or b""
        for what, field in (("key", entry.key), ("parent", parent)):
            if len(field) > _MAX_U16:
                raise ValueError(f"{what} is {len(field)} bytes; at most {_MAX_U16} fit the format")
        try:
            header = b"".join(
                (
                    _PREAMBLE.pack(MAGIC, FORMAT_VERSION),
                    _U16.pack(len(self._fingerprint_bytes)),
                    self._fingerprint_bytes,
                    _U16.pack(len(entry.key)),
                    entry.key,
                    _U16.pack(len(parent)),
                    parent,
                    _U32.pack(len(entry.token_ids)),
                    struct.pack(f"<{len(entry.token_ids)}i", *entry.token_ids),
                    _U8.pack(code),
                    _U8.pack(kv.dim()),
                    struct.pack(f"<{kv.dim()}q", *kv.shape),
                )
            )
            payload = self._compressor().compress(raw)
            header += _TRAILER.pack(entry.created, raw.nbytes, len(payload))
        except struct.error as exc:
            raise ValueError(f"cannot encode entry {entry.key.hex()}: {exc}") from exc
        return b"".join((header, _checksum(header, payload), payload))

    def decode(self, data: bytes, expected_key: bytes | None = None) -> CacheEntry:
        """The entry held in ``data``.

        Args:
            data: bytes produced by ``encode`` (of a codec with the same fingerprint).
            expected_key: when given, the key the caller looked up; an entry
                carrying another key is rejected.

        Raises:
            CorruptEntryError: for anything but an intact entry of this model.
        """
        reader = _Reader(memoryview(data))
        magic, version = reader.unpack(_PREAMBLE, "magic")
        if magic != MAGIC:
            raise CorruptEntryError(f"not a tierserve KV entry: magic {bytes(magic)!r}, expected {MAGIC!r}")
        if version != FORMAT_VERSION:
            raise CorruptEntryError(f"unsupported format version {version}; this build reads {FORMAT_VERSION}")
        fingerprint = reader.sized("fingerprint")
        if fingerprint != self._fingerprint_bytes:
            theirs = bytes(fingerprint).decode(errors="replace")
            raise CorruptEntryError(f"foreign entry: written for model {theirs!r}, this is {self.fingerprint!r}")
        key = bytes(reader.sized("key"))
        if expected_key is not None and key != expected_key:
            raise CorruptEntryError(f"key mismatch: entry holds {key.hex()}, looked up {expected_key.hex()}")
        parent = bytes(reader.sized("parent")) or None
        (num_tokens,) = reader.unpack(_U32, "token count")
        token_ids = struct.unpack(f"<{num_tokens}i", reader.take(4 * num_tokens, "token ids"))
        (code,) = reader.unpack(_U8, "dtype")
        dtype_name = _DTYPE_BY_CODE.get(code)
        if dtype_name is None:
            raise CorruptEntryError(f"unknown dtype code {code}; known: {sorted(_DTYPE_BY_CODE)}")
        (ndim,) = reader.unpack(_U8, "shape")
        shape = struct.unpack(f"<{ndim}q", reader.take(8 * ndim, "shape"))
        created, raw_length, compressed_length = reader.unpack(_TRAILER, "sizes")
        header_end = reader.pos
        checksum = bytes(reader.take(_CHECKSUM_SIZE, "checksum"))

        if any(dim < 0 for dim in shape):
            raise CorruptEntryError(f"negative dimension in shape {shape}")
        if math.prod(shape) * _ITEMSIZE[dtype_name] != raw_length:
            raise CorruptEntryError(f"shape {shape} of torch.{dtype_name} does not make {raw_length} bytes")
        left = len(reader.data) - reader.pos
        if left < compressed_length:
            raise CorruptEntryError(f"truncated payload: {left} of {compressed_length} bytes")
        if left > compressed_length:
            raise CorruptEntryError(f"{left - compressed_length} bytes of trailing garbage")
        payload = reader.data[reader.pos :]
        if _checksum(reader.data[:header_end], payload) != checksum:
            raise CorruptEntryError("checksum mismatch")
        raw = self._decompress(payload, raw_length)

        import torch

        dtype = getattr(torch, dtype_name)
        if raw_length:
            kv = torch.frombuffer(raw, dtype=dtype).reshape(shape)
        else:
            kv = torch.empty(shape, dtype=dtype)
        return CacheEntry(key=key, parent=parent, token_ids=token_ids, kv=kv, created=created)

    def _decompress(self, payload: memoryview, raw_length: int) -> bytearray:
        # Check the frame's own size claim first: decompress allocates what the
        # frame header says, so a damaged header must not reach it.
        try:
            frame_length = zstandard.frame_content_size(payload)
        except zstandard.ZstdError as exc:
            raise CorruptEntryError(f"payload is not a zstd frame: {exc}") from exc
        if frame_length != raw_length:
            raise CorruptEntryError(f"zstd frame holds {frame_length} bytes, header says {raw_length}")
        try:
            raw = self._decompressor().decompress(payload, max_output_size=raw_length)
        except Exception as exc:  # zstandard raises ZstdError, but be total here
            raise CorruptEntryError(f"decompression failed: {exc}") from exc
        if len(raw) != raw_length:
            raise CorruptEntryError(f"payload decompressed to {len(raw)} bytes, header says {raw_length}")
        return bytearray(raw)  # writable, so the tensor built on it owns ordinary memory

    def _compressor(self) -> zstandard.ZstdCompressor:
        compressor = getattr(self._local, "compressor", None)
        if compressor is None:
            compressor = self._local.compressor = zstandard.ZstdCompressor(level=self.level, write_checksum=True)
        return compressor

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        decompressor = getattr(self._local, "decompressor", None)
        if decompressor is None:
            decompressor = self._local.decompressor = zstandard.ZstdDecompressor()
        return decompressor


def _checksum(header: bytes | memoryview, payload: bytes | memoryview) -> bytes:
    digest = hashlib.blake2b(header, digest_size=_CHECKSUM_SIZE)
    digest.update(payload)
    return digest.digest()
