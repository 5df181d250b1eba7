"""Chained block hashes: h_i = H(h_{i-1}, tokens_i), rooted in the model fingerprint and a tenant salt.

The hash is blake2b (not Python's salted ``hash``), so a key means the same
thing after a restart and in another process; the root folds in the model
fingerprint, the block size and the optional ``cache_salt``, so no prefix is
ever shared across models, layouts or tenants.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_BYTES = 16


def root_hash(fingerprint: str, block_size: int, cache_salt: str | None = None) -> bytes:
    """The parent of a prompt's first block."""
    material = f"tierserve-kv-v1\0{fingerprint}\0{block_size}\0{cache_salt or ''}".encode()
    return hashlib.blake2b(material, digest_size=HASH_BYTES).digest()


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of one full block given its parent's hash."""
    digest = hashlib.blake2b(parent, digest_size=HASH_BYTES)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


def extend_hashes(hashes: list[bytes], root: bytes, token_ids: Sequence[int], block_size: int, num_tokens: int) -> None:
    """Append to ``hashes`` the hashes of every full block within the first ``num_tokens`` tokens."""
    for index in range(len(hashes), num_tokens // block_size):
        parent = hashes[-1] if hashes else root
        hashes.append(block_hash(parent, token_ids[index * block_size : (index + 1) * block_size]))
