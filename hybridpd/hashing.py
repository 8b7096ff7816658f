"""The vLLM-compatible block-hash chain, at ``prefix_match_unit`` granularity.

Contract (identical bytes to vLLM 0.32 ``hash_block_tokens`` with
``sha256_cbor`` / ``xxhash_cbor``)::

    h_i = H(cbor2.dumps((h_{i-1} or NONE_HASH, tuple(tokens_i), extra_keys_i),
                        canonical=True))
    NONE_HASH = H(cbor2.dumps(seed, canonical=True))

``extra_keys_i`` is ``None`` or a tuple: ``("lora", name, path)`` on every
block when a LoRA adapter is named, plus ``("cache_salt", salt)`` appended on
block 0 only (vLLM 0.32's keys and order: lora, then salt). Only full blocks
are hashed. ``tests/vllm/test_hash_equality.py`` checks this against vLLM's
own ``get_request_block_hasher`` in the vLLM environment.

NOTE: ``cbor2.dumps`` of a 128-int tuple per block dominates vLLM's cost. With
``sha256_cbor`` the whole chain is one call into a small C helper
(``_cbor_tokens.c``): it reads the token ids (a list of ints straight from the
int objects, or an int32/uint32/int64 buffer), encodes each block's ids
(canonical CBOR unsigned ints: 1, 2, 3 or 5 bytes each; AVX-512 compress-store
where the CPU has it, else branch-free scalar code), splices the fixed CBOR
framing around them and hashes with the CPU's SHA extensions where it has them.
A list is read a few ids at a time between SHA-256 compressions, holding the
GIL throughout (SHA-256 itself is most of that time); buffers are hashed
without the GIL (``bench.hashing`` times both against vLLM's hasher).
Otherwise (``xxhash_cbor``, an old build, no SHA-NI) we encode all blocks at
once (the C helper, or numpy when it is not built) and hash with one
``hashlib``/``xxhash`` call per block. Property tests check byte equality with
``cbor2`` on every path.
"""

from __future__ import annotations

import enum
import hashlib
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NewType

import cbor2
import numpy as np
import xxhash

try:  # NOTE: optional C encoder (setup.py); numpy is the documented fallback.
    from hybridpd import _cbor_tokens as _c_encoder  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - exercised when the build is skipped
    _c_encoder = None

BlockHash = NewType("BlockHash", bytes)

#: Seed used when neither the config nor ``PYTHONHASHSEED`` provides one.
DEFAULT_HASH_SEED = "vllm-none-hash"

# NOTE: the blocks this process hashed through ``BlockHasher.chain``. The router hashes
# each prompt once and the chain travels with the request (``EngineRequest.block_hashes``),
# so the prefill and decode processes hash only what no one hashed before (an answer's new
# blocks, a request that came without a chain). A lock: a chain costs microseconds to
# milliseconds, the increment under it nanoseconds.
_hashed_lock = threading.Lock()
_hashed = [0]


def _count(n_blocks: int) -> None:
    with _hashed_lock:
        _hashed[0] += n_blocks


def hashed_blocks() -> int:
    """Blocks this process has hashed (``BlockHasher.chain``) since it started: the
    router's ``hybridpd_hashed_blocks_total``, each worker's ``hashed_blocks`` stat."""
    with _hashed_lock:
        return _hashed[0]


class HashAlgo(enum.StrEnum):
    """Hash function over canonical CBOR, named as vLLM names them."""

    SHA256_CBOR = "sha256_cbor"
    XXHASH_CBOR = "xxhash_cbor"


def _digest(algo: HashAlgo, data: bytes) -> bytes:
    if algo is HashAlgo.SHA256_CBOR:
        return hashlib.sha256(data).digest()
    return xxhash.xxh3_128_digest(data)


def hash_cbor(algo: HashAlgo, obj: Any) -> bytes:
    """``H(cbor2.dumps(obj, canonical=True))``: the slow, obviously-right path."""
    return _digest(algo, cbor2.dumps(obj, canonical=True))


def default_seed() -> str:
    """``PYTHONHASHSEED`` when set (what vLLM uses), else :data:`DEFAULT_HASH_SEED`."""
    return os.environ.get("PYTHONHASHSEED") or DEFAULT_HASH_SEED


def _cbor_head(major: int, n: int) -> bytes:
    """Canonical CBOR head for major type ``major`` and argument ``n``."""
    mt = major << 5
    if n < 24:
        return bytes([mt | n])
    if n < 1 << 8:
        return bytes([mt | 24, n])
    if n < 1 << 16:
        return bytes([mt | 25]) + n.to_bytes(2, "big")
    if n < 1 << 32:
        return bytes([mt | 26]) + n.to_bytes(4, "big")
    return bytes([mt | 27]) + n.to_bytes(8, "big")


# Numpy fallback encoder. Row layout, 8 bytes per token (little-endian u64):
# byte 0 = the CBOR head for widths 2, 3, 5; bytes 4..7 = the value, big-endian.
_HEAD = np.array([0, 0, 0x18, 0x19, 0, 0x1A], dtype=np.uint64)


def _byte_mask(cols: list[int]) -> int:
    return sum(0xFF << (8 * c) for c in cols)


_KEEP = (
    np.array(
        [0, _byte_mask([7]), _byte_mask([0, 7]), _byte_mask([0, 6, 7]), 0, _byte_mask([0, 4, 5, 6, 7])],
        dtype=np.uint64,
    )
    .view(np.uint8)
    .reshape(6, 8)
    .astype(bool)
)


def _encode_uints(tokens: np.ndarray) -> tuple[bytes, np.ndarray]:
    """Canonical CBOR of each token, concatenated, and the byte offset of each.

    Returns ``(buf, offsets)`` with ``len(offsets) == len(tokens) + 1``.
    Tokens must lie in ``[0, 2**32)``.
    """
    u = tokens.astype(np.uint32)
    width = 1 + (u >= 24).view(np.int8) + (u >= 1 << 8).view(np.int8) + 2 * (u >= 1 << 16).view(np.int8)
    rows = _HEAD[width] | (u.byteswap().astype(np.uint64) << np.uint64(32))
    buf = rows.view(np.uint8)[_KEEP[width].reshape(-1)].tobytes()
    offsets = np.zeros(u.size + 1, dtype=np.int64)
    np.cumsum(width, out=offsets[1:])
    return buf, offsets


def _c_chain_ok() -> bool:
    """Whether the one-call C chain (sha256_cbor) is worth using: built, and SHA-NI
    (without it, OpenSSL's hashlib per block is as fast as portable C)."""
    return _c_encoder is not None and getattr(_c_encoder, "has_sha_ni", lambda: False)()


def _encode_blocks(tokens: Sequence[int] | np.ndarray, unit: int) -> tuple[bytes, list[int]] | None:
    """``(buf, block_starts)`` for the full blocks, or None if a token is
    outside ``[0, 2**32)`` (the caller then takes the generic cbor2 path)."""
    if _c_encoder is not None:
        try:
            buf, starts = _c_encoder.encode(tokens, unit)
        except OverflowError:
            return None
        return buf, np.frombuffer(starts, dtype=np.int64).tolist()
    arr = np.asarray(tokens)
    arr = arr[: arr.size // unit * unit]
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 1 << 32):
        return None
    buf, offs = _encode_uints(arr)
    return buf, offs[::unit].tolist()


def join_prefixed(prefix: bytes, hashes: Sequence[bytes]) -> bytes:
    """``prefix + h_1 + prefix + h_2 + ...`` (the index lookup's chain argument);
    ValueError unless the hashes are bytes of one length. In C when built (a
    Python ``join`` of 1,281 hashes plus the length check costs ~0.1 ms)."""
    if _c_encoder is not None and hasattr(_c_encoder, "join_prefixed"):
        return bytes(_c_encoder.join_prefixed(prefix, hashes))
    if not hashes:
        return b""
    if len({len(h) for h in hashes}) != 1 or not all(isinstance(h, bytes) for h in hashes):
        raise ValueError("hashes must be bytes of one length")
    return prefix + prefix.join(hashes)


@dataclass(frozen=True, slots=True)
class BlockHasher:
    """Computes block-hash chains for one (algorithm, unit, seed).

    Stateless after construction and safe to share between threads.
    """

    unit: int
    algo: HashAlgo = HashAlgo.SHA256_CBOR
    seed: str = field(default_factory=default_seed)
    none_hash: BlockHash = field(init=False)

    def __post_init__(self) -> None:
        if self.unit <= 0:
            raise ValueError("unit must be positive, got %d" % self.unit)
        object.__setattr__(self, "algo", HashAlgo(self.algo))
        object.__setattr__(self, "none_hash", BlockHash(hash_cbor(self.algo, self.seed)))

    @staticmethod
    def extra_keys(block_index: int, cache_salt: str | None, adapter: tuple[str, str] | None) -> tuple[Any, ...] | None:
        """vLLM's per-block extra keys: the adapter (name, path) on every block, the salt on block 0."""
        keys: list[Any] = []
        if adapter:
            keys.append(("lora", adapter[0], adapter[1]))
        if block_index == 0 and cache_salt:
            keys.append(("cache_salt", cache_salt))
        return tuple(keys) if keys else None

    def hash_block(
        self, parent: BlockHash | None, tokens: Sequence[int], extra_keys: tuple[Any, ...] | None = None
    ) -> BlockHash:
        """One link of the chain via ``cbor2`` (reference path)."""
        return BlockHash(hash_cbor(self.algo, (parent or self.none_hash, tuple(int(t) for t in tokens), extra_keys)))

    def chain(
        self,
        tokens: Sequence[int] | np.ndarray,
        *,
        cache_salt: str | None = None,
        adapter: tuple[str, str] | None = None,
        parent: BlockHash | None = None,
        first_block_index: int = 0,
    ) -> list[BlockHash]:
        """Hashes of every full ``unit``-token block of ``tokens``.

        ``parent``/``first_block_index`` continue an existing chain: pass the
        last known hash and the index of the block ``tokens[0]`` starts, so a
        growing prompt is hashed incrementally.
        """
        n_blocks = len(tokens) // self.unit
        if n_blocks == 0:
            return []
        _count(n_blocks)
        if self.algo is HashAlgo.SHA256_CBOR and _c_chain_ok():
            tail_first = cbor2.dumps(self.extra_keys(first_block_index, cache_salt, adapter), canonical=True)
            tail_rest = cbor2.dumps(self.extra_keys(1, cache_salt, adapter), canonical=True)
            try:
                return _c_encoder.sha256_chain(tokens, self.unit, parent or self.none_hash, tail_first, tail_rest)
            except OverflowError:
                arr = np.asarray(tokens, dtype=object)[: n_blocks * self.unit]
                return self._chain_slow(arr, cache_salt, adapter, parent, first_block_index)
        encoded = _encode_blocks(tokens, self.unit)
        if encoded is None:
            arr = np.asarray(tokens, dtype=object)[: n_blocks * self.unit]
            return self._chain_slow(arr, cache_salt, adapter, parent, first_block_index)
        buf, starts = encoded
        array_head = _cbor_head(4, self.unit)
        tail_plain = cbor2.dumps(self.extra_keys(1, cache_salt, adapter), canonical=True)
        hash_fn = hashlib.sha256 if self.algo is HashAlgo.SHA256_CBOR else xxhash.xxh3_128
        prev: bytes = parent or self.none_hash
        # The parent is a digest of this algorithm, except possibly a caller's.
        first_head = _cbor_head(2, len(prev))
        digest_head = _cbor_head(2, len(self.none_hash))
        out: list[BlockHash] = []
        for i in range(n_blocks):
            idx = first_block_index + i
            tail = tail_plain if idx != 0 else cbor2.dumps(self.extra_keys(0, cache_salt, adapter), canonical=True)
            head = first_head if i == 0 else digest_head
            prev = hash_fn(b"\x83" + head + prev + array_head + buf[starts[i] : starts[i + 1]] + tail).digest()
            out.append(BlockHash(prev))
        return out

    def extend(
        self, known: Sequence[BlockHash], tokens: Sequence[int], *, cache_salt: str | None = None
    ) -> list[BlockHash]:
        """The chain of ``tokens`` (``chain``), where ``known`` is the chain of a prefix
        of them computed elsewhere (the router's: ``EngineRequest.block_hashes``):
        only the blocks after ``known`` are hashed, none when it covers them all
        (a longer ``known`` is cut to ``tokens``' full blocks). ``known`` is trusted
        as it comes (it travels inside the cluster, from the process that hashed
        the same tokens); ValueError unless its hashes have this algorithm's length."""
        n_blocks = len(tokens) // self.unit
        have = list(known[:n_blocks])
        if have and not all(isinstance(h, bytes) and len(h) == len(self.none_hash) for h in have):
            raise ValueError("known chain hashes must be %d-byte digests" % len(self.none_hash))
        if len(have) == n_blocks:
            return have
        if not have:
            return self.chain(tokens, cache_salt=cache_salt)
        k = len(have)
        rest = tokens[k * self.unit :]
        return have + self.chain(rest, cache_salt=cache_salt, parent=have[-1], first_block_index=k)

    def _chain_slow(
        self,
        arr: np.ndarray,
        cache_salt: str | None,
        adapter: tuple[str, str] | None,
        parent: BlockHash | None,
        first_block_index: int,
    ) -> list[BlockHash]:
        out: list[BlockHash] = []
        prev = parent
        for i in range(arr.size // self.unit):
            block = arr[i * self.unit : (i + 1) * self.unit].tolist()
            prev = self.hash_block(prev, block, self.extra_keys(first_block_index + i, cache_salt, adapter))
            out.append(prev)
        return out
