"""The whole local stack, started the way a user starts it: `hybridpd up`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hybridpd.config import load_config
from hybridpd.engine.base import EngineRequest, RequestId, SamplingParams
from hybridpd.engine.native.engine import NativeEngine
from hybridpd.engine.native.tiny import resolve_model_dir
from hybridpd.tokenizer import TextTokenizer
from launch.stack_process import StackProcess


class Stack(StackProcess):
    def stats(self) -> dict:
        return httpx.get(self.http + "/v1/hybridpd/stats", timeout=30).json()

    def wait_all_free(self, timeout_s: float = 20.0) -> dict:
        """Stats once every actor's pools are back to all-free with nothing running."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            pools = [s["pool"] for s in stats.values()]
            if all(p["num_free_blocks"] == p["num_blocks"] and p["num_running"] == 0 for p in pools):
                return stats
            if time.monotonic() > deadline:
                raise AssertionError("blocks not freed: %s" % stats)
            time.sleep(0.2)


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(
        Path(tmp_path_factory.mktemp("stack")), ["--eagle", "--max-inflight-requests", "4", "--mamba-block-size", "64"]
    )
    s.start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="session")
def reference(fp32_row_exact: None):  # type: ignore[no-untyped-def]
    """The native engine run monolithically in this process (EAGLE off, no caching);
    compared bit for bit, so only where fp32 matmul rows are batch-invariant."""
    engine = NativeEngine(load_config(env={}, overrides={"enable_prefix_caching": False}))
    tok = TextTokenizer(resolve_model_dir("tiny"))
    counter = iter(range(10**9))

    def run(tokens: list[int], max_tokens: int) -> list[int]:
        sp = SamplingParams(max_tokens=max_tokens, stop_token_ids=tok.stop_token_ids)
        rid = "ref-%d" % next(counter)
        return engine.generate([EngineRequest(RequestId(rid), tuple(tokens), sp)])[rid]

    return run, tok
