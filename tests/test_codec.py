"""The L3 entry format: exact round trips, and every damaged input rejected as ``CorruptEntryError`` only."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierserve.cache.codec import FORMAT_VERSION, MAGIC, CorruptEntryError, KVCodec
from tierserve.cache.tier import CacheEntry

pytestmark = pytest.mark.unit

FINGERPRINT = "tiny-llama:float32:bs16"
CODEC = KVCodec(FINGERPRINT)
FUZZ = settings(max_examples=300, deadline=None)


def make_entry(shape=(2, 2, 4, 2, 8), dtype=torch.float32, parent=b"p" * 16, seed=0) -> CacheEntry:
    generator = torch.Generator().manual_seed(seed)
    kv = (torch.randn(shape, generator=generator) * 3).to(dtype)
    return CacheEntry(key=b"k" * 16, parent=parent, token_ids=(5, 0, 2047, 2**31 - 1), kv=kv, created=1234.5)


VALID = CODEC.encode(make_entry())


def _bits(kv: torch.Tensor) -> torch.Tensor:
    return kv.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 2, 4, 2, 8), (1, 2, 16, 1, 4), (7,), (), (0, 2, 16, 1, 4)])
@pytest.mark.parametrize("parent", [None, b"\x00" * 32])
def test_round_trip_is_exact(dtype, shape, parent):
    entry = make_entry(shape, dtype, parent)
    decoded = CODEC.decode(CODEC.encode(entry), expected_key=entry.key)
    assert decoded.kv.dtype == dtype
    assert decoded.kv.shape == entry.kv.shape
    assert torch.equal(_bits(decoded.kv), _bits(entry.kv))
    assert (decoded.key, decoded.parent, decoded.token_ids, decoded.created) == (
        entry.key,
        parent,
        entry.token_ids,
        entry.created,
    )


def test_decoded_tensor_is_writable_and_independent_of_the_input():
    data = bytearray(VALID)
    decoded = CODEC.decode(bytes(data))
    decoded.kv.add_(1)  # must not warn or fail: the tensor owns ordinary memory
    assert CODEC.decode(VALID).kv.equal(make_entry().kv)


def test_non_contiguous_kv_is_stored_in_logical_order():
    kv = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()
    entry = CacheEntry(key=b"k", parent=None, token_ids=(), kv=kv)
    assert torch.equal(CODEC.decode(CODEC.encode(entry)).kv, kv)


def test_layout_starts_with_magic_and_version():
    assert VALID[:6] == MAGIC + struct.pack("<H", FORMAT_VERSION)


def test_low_entropy_tensor_compresses():
    entry = CacheEntry(key=b"k", parent=None, token_ids=(1,), kv=torch.zeros(4, 2, 16, 4, 32))
    assert len(CODEC.encode(entry)) < entry.nbytes / 20


def test_foreign_fingerprint_is_rejected():
    with pytest.raises(CorruptEntryError, match="foreign"):
        KVCodec("another-model").decode(VALID)


def test_expected_key_mismatch_is_rejected():
    with pytest.raises(CorruptEntryError, match="key"):
        CODEC.decode(VALID, expected_key=b"x" * 16)
    assert CODEC.decode(VALID, expected_key=b"k" * 16).key == b"k" * 16


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "truncated"),
        (b"NOPE" + VALID[4:], "magic"),
        (MAGIC + struct.pack("<H", FORMAT_VERSION + 1) + VALID[6:], "version"),
        (VALID + b"\x00", "trailing"),
        (VALID[:-1], "truncated"),
        (VALID[:40], "truncated"),
    ],
)
def test_named_defects(data, message):
    with pytest.raises(CorruptEntryError, match=message):
        CODEC.decode(data)


def test_unknown_dtype_code_is_rejected():
    entry = make_entry()
    data = bytearray(CODEC.encode(entry))
    # the dtype code follows the token ids; find it from the known header layout
    offset = 6 + 2 + len(FINGERPRINT) + 2 + 16 + 2 + 16 + 4 + 4 * len(entry.token_ids)
    assert data[offset] == 1  # float32
    data[offset] = 9
    with pytest.raises(CorruptEntryError, match="dtype"):
        CODEC.decode(bytes(data))


def test_unsupported_dtype_cannot_be_encoded():
    entry = CacheEntry(key=b"k", parent=None, token_ids=(), kv=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="dtype"):
        CODEC.encode(entry)


@FUZZ
@given(st.binary(max_size=512))
def test_any_bytes_are_rejected_cleanly(data):
    with pytest.raises(CorruptEntryError):
        CODEC.decode(data)


@FUZZ
@given(st.binary(max_size=512))
def test_any_bytes_after_a_valid_preamble_are_rejected_cleanly(tail):
    with pytest.raises(CorruptEntryError):
        CODEC.decode(VALID[:6] + tail)


@FUZZ
@given(st.integers(min_value=0, max_value=len(VALID) - 1), st.integers(min_value=1, max_value=255))
def test_any_single_byte_change_is_detected(position, flip):
    data = bytearray(VALID)
    data[position] ^= flip
    with pytest.raises(CorruptEntryError):
        CODEC.decode(bytes(data))


@FUZZ
@given(st.integers(min_value=0, max_value=len(VALID) - 1))
def test_any_truncation_is_detected(length):
    with pytest.raises(CorruptEntryError):
        CODEC.decode(VALID[:length])


@FUZZ
@given(st.integers(min_value=0, max_value=len(VALID)), st.binary(min_size=1, max_size=64))
def test_any_insertion_is_detected(position, extra):
    with pytest.raises(CorruptEntryError):
        CODEC.decode(VALID[:position] + extra + VALID[position:])
