"""Real components for integration tests, started by the fixtures on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridpd.index.redis_server import RedisServer
from hybridpd.store.master import MooncakeMaster


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    srv = RedisServer(Path(tmp_path_factory.mktemp("redis")))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    master = MooncakeMaster(Path(tmp_path_factory.mktemp("mooncake")))
    master.start()
    yield master
    master.stop()
