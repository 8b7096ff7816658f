"""Launch the Mooncake master shipped in the wheel, on free loopback ports.

It serves the store's RPC (``rpc_port``), the HTTP metadata server the
clients use (``metadata_url``) and Prometheus metrics (``metrics_port``).
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from hybridpd.errors import UnavailableError
from hybridpd.procs import ManagedProcess, free_port, port_open


def mooncake_master_binary() -> str:
    here = Path(sys.executable).parent / "mooncake_master"
    if here.exists():
        return str(here)
    found = shutil.which("mooncake_master")
    if found:
        return found
    raise UnavailableError("mooncake_master not found: pip install mooncake-transfer-engine-non-cuda")


class MooncakeMaster(ManagedProcess):
    def __init__(
        self,
        workdir: Path,
        host: str = "127.0.0.1",
        lease_ttl_ms: int = 1000,
        rpc_port: int | None = None,
        metadata_port: int | None = None,
    ) -> None:
        """``rpc_port`` / ``metadata_port``: fixed ports (default: free ones)."""
        self.host = host
        self.rpc_port = rpc_port or free_port(host)
        self.metadata_port = metadata_port or free_port(host)
        self.metrics_port = free_port(host)
        argv = [
            mooncake_master_binary(),
            "--rpc_address",
            host,
            "--rpc_port",
            str(self.rpc_port),
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host",
            host,
            "--http_metadata_server_port",
            str(self.metadata_port),
            "--metrics_host",
            host,
            "--metrics_port",
            str(self.metrics_port),
            "--default_kv_lease_ttl",
            str(lease_ttl_ms),
        ]
        super().__init__("mooncake_master", argv, workdir / ("mooncake-master-%d.log" % self.rpc_port))

    @property
    def address(self) -> str:
        return "%s:%d" % (self.host, self.rpc_port)

    @property
    def metadata_url(self) -> str:
        return "http://%s:%d/metadata" % (self.host, self.metadata_port)

    def start(self, host: str | None = None, port: int | None = None, timeout_s: float = 20.0) -> None:
        super().start(self.host, self.rpc_port, timeout_s)
        deadline = time.monotonic() + timeout_s
        while not port_open(self.host, self.metadata_port):  # metadata server comes up beside the RPC port
            if time.monotonic() > deadline:
                self.stop()
                raise UnavailableError("mooncake metadata server did not come up on port %d" % self.metadata_port)
            time.sleep(0.05)
