"""The baseline of ``hybridpd bench router`` and ``python -m bench.hashing``:
vLLM's own block hashing where vLLM is importable, else a copy of it, and
always labelled as what it is.

``baseline(tokens, unit, seed, algo)`` returns a ``Baseline`` whose ``chain()``
hashes every full block of ``tokens`` (no salt, no adapter) from scratch:

* ``kind = "vllm"`` (the vLLM environment, ``.venv-vllm``): vLLM's request
  block hasher, ``vllm.v1.core.kv_cache_utils.get_request_block_hasher(unit,
  sha256_cbor)`` (or ``xxhash_cbor``, both from ``vllm.utils.hashing``),
  applied to a ``vllm.v1.request.Request`` of the tokens built without a
  hasher, as ``tests/vllm/test_hash_equality.py`` builds one (through
  ``hybridpd.engine.vllm.adapter.request_block_chain``). That call is
  what vLLM runs for a new request's blocks (``Request.update_block_hashes``
  at construction): per block ``generate_block_hash_extra_keys``, a slice of
  ``request.all_token_ids`` and ``hash_block_tokens``. Building the
  ``Request`` is outside the timed call. ``NONE_HASH`` is set by vLLM's own
  ``init_none_hash`` with ``PYTHONHASHSEED`` = our seed.
* ``kind = "copy"`` (vLLM not importable, e.g. the main ``.venv``): this
  module's copy of vLLM 0.32's ``hash_block_tokens`` loop, quoted below, with
  ``hashlib`` / ``xxhash`` over ``cbor2.dumps(..., canonical=True)``, without
  the request bookkeeping around it (so, if anything, faster than vLLM)::

      if not parent_block_hash:
          parent_block_hash = NONE_HASH
      curr_block_token_ids_tuple = tuple(curr_block_token_ids)
      return BlockHash(hash_function((parent_block_hash, curr_block_token_ids_tuple, extra_keys)))

Callers assert ``chain()`` equals ``BlockHasher.chain`` before timing it.
``Baseline.describe()`` is what goes into a result JSON (``baseline``):
``{"kind": "vllm", "vllm_version": ..., "function": ..., "cbor2_version": ...}`` or
``{"kind": "copy", "vllm_version": None, "function": ..., "cbor2_version": ..., "copy_of": ...}``
(either costs mostly ``cbor2.dumps``, so the cbor2 version matters);
``label(d)`` is how printed lines and plots name it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import cbor2
import xxhash

from hybridpd.engine.vllm import adapter
from hybridpd.hashing import HashAlgo

#: what the copy reproduces (``describe()["copy_of"]``)
COPY_OF = "vLLM 0.32 vllm.v1.core.kv_cache_utils.hash_block_tokens"
COPY_LABEL = "copy of vLLM's hash_block_tokens"


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
    """The copy: the chain of every full block of ``tokens`` (no salt, no adapter), block by block."""
    fn = HASH_FUNCTIONS[HashAlgo(algo)]
    out: list[bytes] = []
    prev: bytes | None = None
    for start in range(0, len(tokens) // unit * unit, unit):
        prev = hash_block_tokens(fn, prev, tokens[start : start + unit], none_hash)
        out.append(prev)
    return out


@dataclasses.dataclass(frozen=True)
class Baseline:
    """A baseline chain over fixed tokens. ``chain()`` is the timed call."""

    kind: str  # "vllm" | "copy"
    function: str
    vllm_version: str | None
    chain: Callable[[], list[bytes]]

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "kind": self.kind,
            "vllm_version": self.vllm_version,
            "function": self.function,
            # vLLM's cost is mostly cbor2.dumps, whose speed differs by version (6.3 ~4x faster than 6.2 here)
            "cbor2_version": _version("cbor2"),
        }
        if self.kind == "copy":
            d["copy_of"] = COPY_OF
        return d


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def label(described: dict[str, Any]) -> str:
    """How a baseline (``Baseline.describe()``) is named in printed lines, plots and tables."""
    if described.get("kind") == "vllm":
        return "vLLM %s's own hasher" % (described.get("vllm_version") or "?")
    return COPY_LABEL


@contextlib.contextmanager
def _hash_seed(seed: str) -> Iterator[None]:
    old = os.environ.get("PYTHONHASHSEED")
    os.environ["PYTHONHASHSEED"] = seed
    try:
        yield
    finally:
        if old is None:
            del os.environ["PYTHONHASHSEED"]
        else:
            os.environ["PYTHONHASHSEED"] = old


def _vllm(tokens: list[int], unit: int, seed: str, algo: HashAlgo) -> Baseline | None:
    try:
        release = adapter.version()
    except ImportError:
        return None
    with _hash_seed(seed):  # vLLM's NONE_HASH = fn(PYTHONHASHSEED)
        chain = adapter.request_block_chain(tokens, unit, algo.value)
    function = "vllm.v1.core.kv_cache_utils.get_request_block_hasher(%d, vllm.utils.hashing.%s)(Request)" % (
        unit,
        algo.value,
    )
    return Baseline("vllm", function, release, chain)


def baseline(
    tokens: Sequence[int], unit: int, seed: str, algo: HashAlgo = HashAlgo.SHA256_CBOR, allow_vllm: bool = True
) -> Baseline:
    """vLLM's own request block hasher over ``tokens`` where vLLM imports (and
    ``allow_vllm``), else the copy. ``seed`` is the ``BlockHasher`` seed."""
    algo = HashAlgo(algo)
    as_list = [int(t) for t in tokens]
    got = _vllm(as_list, unit, seed, algo) if allow_vllm else None
    if got is not None:
        return got
    none_hash = HASH_FUNCTIONS[algo](seed)
    return Baseline(
        "copy",
        "bench.vllm_chain.vllm_chain (hashlib/xxhash + cbor2, %s)" % algo.value,
        None,
        lambda: vllm_chain(as_list, unit, none_hash, algo),
    )
