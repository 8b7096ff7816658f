"""The block-hash chain: byte equality with the cbor2 reference, salts, seeds."""

from __future__ import annotations

import hashlib
from typing import Any

import cbor2
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpd import hashing
from hybridpd.hashing import DEFAULT_HASH_SEED, BlockHash, BlockHasher, HashAlgo, default_seed


def reference_chain(
    tokens: list[int],
    unit: int,
    algo: HashAlgo,
    seed: str,
    salt: str | None = None,
    adapter: tuple[str, str] | None = None,
) -> list[bytes]:
    """vLLM's definition, written out with cbor2 + hashlib/xxhash directly."""
    h = hashlib.sha256 if algo is HashAlgo.SHA256_CBOR else None

    def digest(obj: object) -> bytes:
        data = cbor2.dumps(obj, canonical=True)
        return h(data).digest() if h else xxhash.xxh3_128_digest(data)

    parent = digest(seed)
    out = []
    for i in range(len(tokens) // unit):
        keys = ([("lora", *adapter)] if adapter else []) + ([("cache_salt", salt)] if (i == 0 and salt) else [])
        parent = digest((parent, tuple(tokens[i * unit : (i + 1) * unit]), tuple(keys) if keys else None))
        out.append(parent)
    return out


def test_none_hash_is_hash_of_seed() -> None:
    hasher = BlockHasher(unit=16, seed="1234")
    assert hasher.none_hash == hashlib.sha256(cbor2.dumps("1234", canonical=True)).digest()
    x = BlockHasher(unit=16, algo=HashAlgo.XXHASH_CBOR, seed="1234")
    assert x.none_hash == xxhash.xxh3_128_digest(cbor2.dumps("1234", canonical=True))
    assert len(x.none_hash) == 16


def test_default_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert default_seed() == DEFAULT_HASH_SEED
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert default_seed() == "42"


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(
        st.one_of(st.integers(0, 30), st.integers(0, 300), st.integers(0, 70_000), st.integers(0, 2**32 - 1)),
        max_size=200,
    ),
    unit=st.sampled_from([1, 3, 8, 16, 24, 32]),
    algo=st.sampled_from(list(HashAlgo)),
    salt=st.one_of(st.none(), st.text(max_size=8)),
    adapter=st.one_of(st.none(), st.sampled_from([("lora-a", "/adapters/a"), ("x" * 30, "")])),
)
def test_fast_chain_equals_cbor2_reference(
    tokens: list[int], unit: int, algo: HashAlgo, salt: str | None, adapter: tuple[str, str] | None
) -> None:
    hasher = BlockHasher(unit=unit, algo=algo, seed="s")
    want = reference_chain(tokens, unit, algo, "s", salt, adapter)
    assert hasher.chain(tokens, cache_salt=salt, adapter=adapter) == want
    assert hasher.chain(np.asarray(tokens, dtype=np.int64), cache_salt=salt, adapter=adapter) == want
    # the numpy fallback encoder gives the same bytes as the C one
    saved = hashing._c_encoder
    hashing._c_encoder = None
    try:
        assert hasher.chain(tokens, cache_salt=salt, adapter=adapter) == want
    finally:
        hashing._c_encoder = saved
    if algo is HashAlgo.SHA256_CBOR and saved is not None:
        # the one-call C chain, on SHA-NI + the AVX-512 encoder (where the CPU has them)
        # and on portable C (scalar encoder); int32 buffers where the tokens fit
        tails = [cbor2.dumps(hasher.extra_keys(i, salt, adapter), canonical=True) for i in (0, 1)]
        for portable in (False, True):
            assert saved.sha256_chain(tokens, unit, hasher.none_hash, *tails, portable=portable) == want
            if all(t < 2**31 for t in tokens):
                arr32 = np.asarray(tokens, dtype=np.int32)
                assert saved.sha256_chain(arr32, unit, hasher.none_hash, *tails, portable=portable) == want
        # and C encoding + one hashlib call per block (no SHA-NI)
        saved_ok = hashing._c_chain_ok
        hashing._c_chain_ok = lambda: False
        try:
            assert hasher.chain(tokens, cache_salt=salt, adapter=adapter) == want
        finally:
            hashing._c_chain_ok = saved_ok


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(
        st.one_of(st.integers(0, 23), st.integers(0, 300), st.integers(0, 70_000), st.integers(0, 2**32 - 1)),
        max_size=300,
    ),
    unit=st.sampled_from([1, 5, 8, 16, 64, 128]),
)
def test_c_encoders_equal_numpy(tokens: list[int], unit: int) -> None:
    """Both C token encoders (AVX-512 VBMI2 where the CPU has it, branch-free scalar)
    give the numpy encoder's bytes, for lists and uint32/int64 buffers."""
    c = hashing._c_encoder
    assert c is not None, "hybridpd/_cbor_tokens.c is not built (the bootstrap's `pip install -e .` builds it)"
    full = tokens[: len(tokens) // unit * unit]
    buf, offs = hashing._encode_uints(np.asarray(full, dtype=np.int64))
    for portable in (False, True):
        for toks in (tokens, np.asarray(tokens, dtype=np.uint32), np.asarray(tokens, dtype=np.int64)):
            got, starts = c.encode(toks, unit, portable=portable)
            assert got == buf
            assert np.frombuffer(starts, dtype=np.int64).tolist() == offs[::unit].tolist()


def test_c_token_input_kinds() -> None:
    """Lists of ints of every size class and numpy scalars; out-of-range tokens
    fall back to the cbor2 path."""
    hasher = BlockHasher(unit=4, seed="k")
    cases: list[list[Any]] = [
        [0, 1, 2**30 - 1, 2**30, 2**31, 2**32 - 1, 23, 24],  # 1- and 2-digit ints
        [np.int64(5), np.uint32(6), 7, 8],
        [1, 2, 3, -1],
        [1, 2, 3, 2**32],
        [1, 2, 3, 2**70],
    ]
    for toks in cases:
        want = reference_chain([int(t) for t in toks], 4, HashAlgo.SHA256_CBOR, "k")
        assert hasher.chain(toks) == want, toks
    # lists and tuples are read while hashing (SHA-NI): a bad id half-way aborts the
    # C chain (then cbor2 hashes it all); one in the partial last block is never read
    long = [(i * 7919) % 150_000 for i in range(4 * 300 + 3)]
    c = hashing._c_encoder
    for bad_at, value in ((4 * 150 + 1, 2**32), (4 * 299 + 3, -1), (4 * 300 + 1, 2**40)):
        toks = [*long[:bad_at], value, *long[bad_at + 1 :]]
        want = reference_chain(toks, 4, HashAlgo.SHA256_CBOR, "k")
        assert hasher.chain(toks) == want and hasher.chain(tuple(toks)) == want
        if c is not None:
            tails = [cbor2.dumps(None, canonical=True)] * 2
            for portable in (False, True):
                if bad_at < 4 * 300:
                    with pytest.raises(OverflowError):
                        c.sha256_chain(toks, 4, hasher.none_hash, *tails, portable=portable)
                else:
                    assert c.sha256_chain(toks, 4, hasher.none_hash, *tails, portable=portable) == want


def test_join_prefixed() -> None:
    hs = [bytes([i]) * 32 for i in range(5)]
    assert hashing.join_prefixed(b"p:", hs) == b"".join(b"p:" + h for h in hs)
    assert hashing.join_prefixed(b"p:", []) == b""
    saved = hashing._c_encoder
    for enc in (saved, None):
        hashing._c_encoder = enc
        try:
            assert hashing.join_prefixed(b"kv:", hs[:3]) == b"kv:" + hs[0] + b"kv:" + hs[1] + b"kv:" + hs[2]
            for bad in ([hs[0], hs[1][:16]], [hs[0], "x" * 32]):
                with pytest.raises(ValueError):
                    hashing.join_prefixed(b"p:", bad)  # type: ignore[arg-type]
        finally:
            hashing._c_encoder = saved


def test_c_encoder_is_built() -> None:
    # make test builds it (pip install -e .); numpy is only the fallback
    assert hashing._c_encoder is not None
    assert hasattr(hashing._c_encoder, "has_simd_encoder"), "stale build: rerun make bootstrap"


def test_c_chain_long_prompt_and_parent() -> None:
    # many SHA-256 blocks per chain block (unit 128, 5-byte tokens), a caller's parent, a salt
    hasher = BlockHasher(unit=128, seed="long")
    toks = [(i * 2654435761) % (1 << 32) for i in range(128 * 40 + 5)]
    want = reference_chain(toks, 128, HashAlgo.SHA256_CBOR, "long", "salt")
    assert hasher.chain(toks, cache_salt="salt") == want
    assert hasher.chain(np.asarray(toks, dtype=np.int64), cache_salt="salt") == want
    rest = hasher.chain(toks[128 * 10 :], cache_salt="salt", parent=BlockHash(want[9]), first_block_index=10)
    assert rest == want[10:]


def test_only_full_blocks_hashed() -> None:
    hasher = BlockHasher(unit=16)
    assert hasher.chain(list(range(15))) == []
    assert len(hasher.chain(list(range(16)))) == 1
    assert len(hasher.chain(list(range(47)))) == 2


def test_prefix_property_and_incremental() -> None:
    hasher = BlockHasher(unit=8, seed="x")
    toks = list(range(1000, 1100))
    full = hasher.chain(toks, cache_salt="t")
    assert hasher.chain(toks[:40], cache_salt="t") == full[:5]
    rest = hasher.chain(toks[40:], cache_salt="t", parent=full[4], first_block_index=5)
    assert full[:5] + rest == full


def test_salt_and_seed_separate_chains() -> None:
    toks = list(range(64))
    a = BlockHasher(unit=16, seed="x")
    assert a.chain(toks, cache_salt="tenant-a")[0] != a.chain(toks, cache_salt="tenant-b")[0]
    assert a.chain(toks)[0] != a.chain(toks, cache_salt="tenant-a")[0]
    assert a.chain(toks)[0] != BlockHasher(unit=16, seed="y").chain(toks)[0]
    # a different token anywhere changes that block and every later one
    toks2 = list(toks)
    toks2[20] += 1
    c1, c2 = a.chain(toks), a.chain(toks2)
    assert c1[0] == c2[0] and all(x != y for x, y in zip(c1[1:], c2[1:], strict=True))


def test_large_and_numpy_inputs() -> None:
    hasher = BlockHasher(unit=4, seed="z")
    toks = [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1]
    assert hasher.chain(np.array(toks, dtype=np.uint32)) == reference_chain(toks, 4, HashAlgo.SHA256_CBOR, "z")
    big = [2**40, 1, 2, 3, 9]
    assert hasher.chain(big) == reference_chain(big, 4, HashAlgo.SHA256_CBOR, "z")
    assert hasher.chain(np.array(big)) == reference_chain(big, 4, HashAlgo.SHA256_CBOR, "z")


def test_invalid_unit() -> None:
    with pytest.raises(ValueError):
        BlockHasher(unit=0)


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_extend_hashes_only_the_blocks_after_the_known_chain(salt: str | None) -> None:
    """``extend``: the chain of the whole prompt, equal to ``chain``'s, hashing only what
    the known chain (the router's) does not cover, and nothing when it covers it all."""
    h = BlockHasher(unit=4)
    prompt = list(range(1, 31))  # 7 full blocks
    want = h.chain(prompt, cache_salt=salt)
    before = hashing.hashed_blocks()
    assert h.extend(want, prompt, cache_salt=salt) == want
    assert h.extend(want, prompt[:13], cache_salt=salt) == want[:3]  # a longer chain is cut
    assert hashing.hashed_blocks() == before
    assert h.extend(want[:3], prompt, cache_salt=salt) == want
    assert hashing.hashed_blocks() == before + 4
    assert h.extend([], prompt, cache_salt=salt) == want
    assert hashing.hashed_blocks() == before + 4 + 7


def test_extend_refuses_hashes_of_another_length() -> None:
    h = BlockHasher(unit=4)
    with pytest.raises(ValueError, match="32-byte"):
        h.extend([BlockHash(b"x" * 16)], list(range(8)))


def test_an_engine_request_carries_its_chain() -> None:
    from hybridpd.engine.base import EngineRequest, RequestId

    h = BlockHasher(unit=4)
    prompt = tuple(range(1, 19))
    plain = EngineRequest(RequestId("a"), prompt, cache_salt="s")
    want = plain.chain(h)
    routed = EngineRequest(RequestId("a"), prompt, cache_salt="s", block_hashes=tuple(want))
    answer = EngineRequest(RequestId("b"), (*prompt, 7, 8, 9, 10, 11), cache_salt="s", block_hashes=tuple(want))
    before = hashing.hashed_blocks()
    assert routed.chain(h) == want
    assert answer.chain(h)[:4] == want and len(answer.chain(h)) == 5
    assert hashing.hashed_blocks() == before + 2  # the answer's one new block, twice
