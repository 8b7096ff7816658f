"""The whole local stack, started the way a user starts it: `hybridpd up`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hybridpd.stack_process import StackProcess


class Stack(StackProcess):
    def stats(self) -> dict:
        return httpx.get(self.http + "/v1/hybridpd/stats", timeout=30).json()


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(Path(tmp_path_factory.mktemp("stack")), ["--eagle", "--max-inflight-requests", "4"])
    s.start()
    try:
        yield s
    finally:
        s.stop()
