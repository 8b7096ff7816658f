"""The whole local stack, started the way a user starts it: `hybridpd up`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import cached_property
from pathlib import Path

import httpx
import pytest

from hybridpd.config import load_config
from hybridpd.engine.base import EngineRequest, RequestId, SamplingParams
from hybridpd.engine.native.engine import NativeEngine
from hybridpd.engine.profile import profile_of
from hybridpd.hashing import BlockHasher
from hybridpd.index.prefix_index import LookupResult, PrefixIndex
from hybridpd.integrity import block_hash_seed
from hybridpd.models.bundled import resolve_model_dir
from hybridpd.tokenizer import TextTokenizer
from launch.stack_process import StackProcess
from tests.wait import Pending, wait_until


class Stack(StackProcess):
    def stats(self) -> dict:
        """Every actor's stats (with the stack's first operator key, if it has keys)."""
        args = self.extra_args
        flag = "--operator-api-keys"
        keys = args[args.index(flag) + 1].split(",") if flag in args else []
        headers = {"authorization": "Bearer " + keys[0]} if keys else {}
        r = httpx.get(self.http + "/v1/hybridpd/stats", headers=headers, timeout=30)
        r.raise_for_status()
        return r.json()

    def wait_all_free(self, timeout_s: float = 20.0) -> dict:
        """Stats once every actor's pools are back to all-free with nothing running."""

        def free() -> dict | Pending:
            stats = self.stats()
            pools = [s["pool"] for s in stats.values()]
            ok = all(p["num_free_blocks"] == p["num_blocks"] and p["num_running"] == 0 for p in pools)
            return stats if ok else Pending(stats)

        return wait_until(free, timeout_s, 0.2, "every actor's blocks freed")

    # -- the prefix index, as the router reads it (the stacks run on the default u and hash)
    @cached_property
    def index(self) -> PrefixIndex:
        cluster = "--redis-cluster" in self.extra_args
        return PrefixIndex(self.banner("Redis (prefix index)"), self.stats()["prefill-0"]["model_id"], cluster=cluster)

    @cached_property
    def hasher(self) -> BlockHasher:
        """The router's block hasher: its seed derives from the stack's integrity key."""
        key = self.key_args()
        cfg = load_config(env={}, overrides={"integrity_key_file": key[1] if key else None})
        return BlockHasher(unit=cfg.prefix_match_unit, algo=cfg.hash_algo, seed=block_hash_seed(cfg))

    def lookup(self, tokens: Sequence[int], cache_salt: str | None = None) -> LookupResult:
        """What the router's lookup of ``tokens`` finds in the prefix index now."""
        replay = profile_of(load_config(env={}, overrides={"eagle": "--eagle" in self.extra_args})).eagle_drop_prefill
        chain = self.hasher.chain(list(tokens), cache_salt=cache_salt)
        return self.index.lookup(chain, len(tokens), self.hasher.unit, replay)

    def wait_store_hit(
        self, tokens: Sequence[int], at_least: int = 1, cache_salt: str | None = None, timeout_s: float = 30.0
    ) -> int:
        """The store hit the index promises for ``tokens`` once it is ``at_least``
        tokens: a prefill's checkpoint is put in MooncakeStore and published in the
        index asynchronously, after its request returned."""

        def hit() -> int | Pending:
            got = self.lookup(tokens, cache_salt).store_hit
            return got if got >= at_least else Pending(got)

        return wait_until(hit, timeout_s, 0.1, "a store hit of at least %d tokens in the index" % at_least)


#: the flags of the shared stack but its state block size
STACK_ARGS = ["--eagle", "--max-inflight-requests", "4"]
#: whether this stack's EAGLE hits replay a unit (``EngineProfile.eagle_drop_prefill``): False,
#: the native engine's draft head replays nothing, so its hits sit where plain hits do
REPLAY = profile_of(load_config(env={}, overrides={"eagle": True})).eagle_drop_prefill


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The shared stack, at mamba_block_size B = 64 (vLLM's align-mode columns: the
    junction and growing-stream tests rely on its column rule) and without
    checkpoint placement (the junction tests pin which request pays; placement
    depends on the divergences the router saw, i.e. on test order:
    test_placement.py has its own stack); test_serving.py also runs its
    equality tests on a stack at the default B = u, placement on."""
    args = [*STACK_ARGS, "--mamba-block-size", "64", "--checkpoint-placement", "off"]
    s = Stack(Path(tmp_path_factory.mktemp("stack")), args)
    s.start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="session")
def reference(fp32_row_exact: None):  # type: ignore[no-untyped-def]
    """The native engine run monolithically in this process (EAGLE off, no caching):
    the stack's greedy tokens must equal its, so only where fp32 matmul rows are
    batch-invariant."""
    engine = NativeEngine(load_config(env={}, overrides={"enable_prefix_caching": False}), resolve_model_dir("tiny"))
    tok = TextTokenizer(resolve_model_dir("tiny"))
    counter = iter(range(10**9))

    def run(tokens: list[int], max_tokens: int) -> list[int]:
        sp = SamplingParams(max_tokens=max_tokens, stop_token_ids=tok.stop_token_ids)
        rid = "ref-%d" % next(counter)
        return engine.generate([EngineRequest(RequestId(rid), tuple(tokens), sp)])[rid]

    return run, tok
