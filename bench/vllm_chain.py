"""vLLM 0.32's block-hash chain, computed the way vLLM computes it: the
baseline of ``python -m bench.hashing`` and ``hybridpd bench router``.

vLLM hashes a request's blocks one at a time with ``hash_block_tokens``
(``vllm/v1/core/kv_cache_utils.py``)::

    if not parent_block_hash:
        parent_block_hash = NONE_HASH
    curr_block_token_ids_tuple = tuple(curr_block_token_ids)
    return BlockHash(hash_function((parent_block_hash, curr_block_token_ids_tuple, extra_keys)))

with ``hash_function = sha256_cbor`` (``hashlib.sha256(cbor2.dumps(obj,
canonical=True)).digest()``) or ``xxhash_cbor``. Reproduced here without the
request bookkeeping around it (vLLM's per-block ``generate_block_hash_extra_keys``
and the list slicing of ``request.all_token_ids`` add to its time), so this
baseline is, if anything, faster than vLLM itself.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import cbor2
import xxhash

from hybridpd.hashing import HashAlgo


def sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def xxhash_cbor(obj: Any) -> bytes:
    return xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


HASH_FUNCTIONS: dict[HashAlgo, Callable[[Any], bytes]] = {
    HashAlgo.SHA256_CBOR: sha256_cbor,
    HashAlgo.XXHASH_CBOR: xxhash_cbor,
}


def hash_block_tokens(
    hash_function: Callable[[Any], bytes],
    parent_block_hash: bytes | None,
    curr_block_token_ids: Sequence[int],
    none_hash: bytes,
    extra_keys: tuple[Any, ...] | None = None,
) -> bytes:
    if not parent_block_hash:
        parent_block_hash = none_hash
    curr_block_token_ids_tuple = tuple(curr_block_token_ids)
    return hash_function((parent_block_hash, curr_block_token_ids_tuple, extra_keys))


def vllm_chain(
    tokens: Sequence[int], unit: int, none_hash: bytes, algo: HashAlgo = HashAlgo.SHA256_CBOR
) -> list[bytes]:
    """The chain of every full block of ``tokens`` (no salt, no adapter), block by block."""
    fn = HASH_FUNCTIONS[HashAlgo(algo)]
    out: list[bytes] = []
    prev: bytes | None = None
    for start in range(0, len(tokens) // unit * unit, unit):
        prev = hash_block_tokens(fn, prev, tokens[start : start + unit], none_hash)
        out.append(prev)
    return out
