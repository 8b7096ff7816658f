"""vLLM's own prefill/decode disaggregation: the ``vllm-pd`` baseline.

What a user would run instead of hybridpd to split prefill from decode with
vLLM alone: two ``vllm serve`` processes (the same model and flags as
``vllm-direct``: :func:`bench.vllm_direct.serve_argv`), both with
``--kv-transfer-config`` :data:`KV_TRANSFER_CONFIG` (vLLM's NixlConnector,
``kv_both``, KV staged in host memory) and each with its own NIXL side-channel
port, and a small proxy in front of them (``bench.vllm_pd_proxy``, run as ``python
-m bench.vllm_pd --prefill URL --decode URL --port P``; the proxy's module doc
says how it splits a request and what ``cached_tokens`` means through it).
It is a benchmark baseline, not part of hybridpd.

Two deviations from ``vllm serve`` as it ships, both for small CPU machines
(our ``--engine vllm`` stack turns the progress thread off too, and runs each
engine on one thread); without them the servers' prefills stall on two cores.
How ``vllm-pd`` runs as shipped is not measured (bench/README.md).

* **NIXL's progress thread is off** (``hybridpd.engine.vllm.patches.
  nixl_without_progress_thread``): vLLM creates its NIXL agent with the UCX
  progress thread, which NIXL's Python API runs with no delay, a free spin of
  one core per engine (docs/DESIGN.md section 3, the handoff); two engines spin both
  cores here. Nothing is lost without it: vLLM's scheduler keeps stepping an
  engine while a finished request's blocks wait for the remote read
  (``Scheduler.has_finished_requests``: requests held for delayed connector
  cleanup), and every step drives NIXL (``get_finished``). The servers run as
  ``python -m bench.vllm_pd --vllm serve ...`` with
  :data:`NO_PROGRESS_THREAD_ENV` set: this module applies the change when
  imported with it (in the API server and in every process vLLM starts, which
  import it again as their main module) and hands the arguments to vLLM's own
  CLI. ``VllmPd(nixl_progress_thread=True)`` runs ``vllm serve`` unchanged.
* **Each server gets its own half of the CPUs** (:func:`split_cpus`, vLLM's
  ``VLLM_CPU_OMP_THREADS_BIND``; one core each here), as P/D gives prefill and
  decode their own devices; ``vllm-direct`` binds all of them (vLLM's
  ``auto``), our stack's engines run one thread each. Left to ``auto``, both
  servers bind OpenMP threads to the same cores, and on a CPU without
  AVX512-BF16 vLLM's GDN prefill falls back to torch's bf16 depthwise
  ``conv1d``, one OpenMP region per channel, which oversubscribed threads slow
  by orders of magnitude.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.vllm_direct import KV_CACHE_GIB, VllmServer, default_sigint, interrupt, log_tail, tiny_model
from bench.vllm_pd_proxy import make_app
from hybridpd.errors import UnavailableError
from hybridpd.procs import free_port, listen_ports, split_cpus

#: both servers' KV connector: vLLM's NixlConnector in either role, buffers in host memory
KV_TRANSFER_CONFIG: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}

#: set (to "1") in a server's environment: importing this module turns NIXL's UCX
#: progress thread off (see the module doc); vLLM's processes import it as their main module
NO_PROGRESS_THREAD_ENV = "HYBRIDPD_VLLM_PD_NO_NIXL_PROGRESS_THREAD"

_REPO = Path(__file__).resolve().parent.parent

if os.environ.get(NO_PROGRESS_THREAD_ENV) == "1":
    from hybridpd.engine.vllm.patches import nixl_without_progress_thread

    nixl_without_progress_thread()


class VllmPd:
    """vLLM's own P/D on loopback: a prefill and a decode ``vllm serve`` (the
    ``vllm-direct`` command line, :class:`bench.vllm_direct.VllmServer`, plus
    ``--kv-transfer-config`` and a NIXL side-channel port each) and the proxy
    (``python -m bench.vllm_pd`` in this Python) in front; ``.http`` is the proxy.
    ``nixl_progress_thread``: False (the default) runs the servers without NIXL's
    progress thread, True as vLLM ships; ``cpus``: the prefill and the decode
    server's CPUs (default :func:`split_cpus` of this process's; the module doc
    says why both).

    The three start together; if one exits before the proxy reports both servers
    healthy, all are stopped and ``UnavailableError`` carries that one's log
    tail. One that exits while serving makes the requests through it fail (the
    proxy answers 502 naming it), and leaving the ``with`` block on that error
    raises ``UnavailableError`` naming the process and its log tail."""

    def __init__(
        self,
        venv: Path,
        workdir: Path,
        unit: int,
        max_model_len: int,
        *,
        shared_prefix_checkpoint: bool = True,
        nixl_progress_thread: bool = False,
        cpus: tuple[Sequence[int], Sequence[int]] | None = None,
        start_timeout_s: float = 900,
    ) -> None:
        model = tiny_model(venv)
        kv = ["--kv-transfer-config", json.dumps(KV_TRANSFER_CONFIG)]
        side = listen_ports(2)
        self.cpus = split_cpus(sorted(os.sched_getaffinity(0))) if cpus is None else cpus

        def server(role: str, side_port: int, cpus: Sequence[int]) -> VllmServer:
            env = {
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port),
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)),
            }
            if not nixl_progress_thread:
                env.update({NO_PROGRESS_THREAD_ENV: "1", "PYTHONPATH": _pythonpath()})
            srv = VllmServer(
                venv,
                workdir,
                unit,
                max_model_len,
                "vllm-pd-%s.log" % role,
                shared_prefix_checkpoint=shared_prefix_checkpoint,
                extra_argv=kv,
                env=env,
                model=model,
            )
            if not nixl_progress_thread:  # the same arguments, through this module (see the module doc)
                srv.argv[:1] = [str(venv / "bin" / "python"), "-m", "bench.vllm_pd", "--vllm"]
            return srv

        self.prefill = server("prefill", side[0], self.cpus[0])
        self.decode = server("decode", side[1], self.cpus[1])
        self.port = free_port()
        self.proxy_log = workdir / "vllm-pd-proxy.log"
        self.proxy_argv = [
            sys.executable,
            "-m",
            "bench.vllm_pd",
            "--prefill",
            self.prefill.http,
            "--decode",
            self.decode.http,
            "--port",
            str(self.port),
        ]
        self.proxy: subprocess.Popen[bytes] | None = None
        self.start_timeout_s = start_timeout_s
        self.nixl_progress_thread = nixl_progress_thread

    def describe(self) -> str:
        """One line on the setup, for a benchmark's JSON."""
        return (
            "vLLM's own P/D: a prefill and a decode vllm serve (bench/vllm_direct.py serve_argv +"
            " --kv-transfer-config %s; OpenMP on CPUs %s and %s; KV space %s GiB each), NIXL progress thread %s,"
            " and a proxy (bench/vllm_pd.py)"
            % (
                json.dumps(KV_TRANSFER_CONFIG),
                list(self.cpus[0]),
                list(self.cpus[1]),
                KV_CACHE_GIB,
                "on (as vLLM ships)" if self.nixl_progress_thread else "off",
            )
        )

    @property
    def http(self) -> str:
        return "http://127.0.0.1:%d" % self.port

    def exited(self) -> list[str]:
        """Each process that has exited: its role, exit status and log tail."""
        out = []
        for role, srv in (("prefill vllm serve", self.prefill), ("decode vllm serve", self.decode)):
            rc = srv.exited()
            if rc is not None:
                out.append("the %s exited (status %d); its log %s ends:\n%s" % (role, rc, srv.log, log_tail(srv.log)))
        if self.proxy is not None and self.proxy.poll() is not None:
            out.append(
                "the proxy exited (status %d); its log %s ends:\n%s"
                % (self.proxy.returncode, self.proxy_log, log_tail(self.proxy_log))
            )
        return out

    def _ready(self) -> bool:
        try:
            return httpx.get(self.http + "/health", timeout=10).status_code == 200
        except httpx.HTTPError:
            return False

    def __enter__(self) -> VllmPd:
        try:
            self.prefill.start()
            self.decode.start()
            env = {**os.environ, "PYTHONPATH": _pythonpath()}
            with open(self.proxy_log, "w") as out:
                self.proxy = subprocess.Popen(
                    self.proxy_argv,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=_REPO,
                    preexec_fn=default_sigint,
                )
        except OSError as exc:
            self.stop()
            raise UnavailableError("vllm-pd did not start: %r" % exc) from exc
        deadline = time.monotonic() + self.start_timeout_s
        while not self._ready():
            dead = self.exited()
            if dead or time.monotonic() > deadline:
                self.stop()
                raise UnavailableError(
                    "vllm-pd did not start: "
                    + ("\n".join(dead) if dead else "not healthy after %.0f s" % self.start_timeout_s)
                )
            time.sleep(1.0)
        return self

    def stop(self) -> None:
        interrupt(self.proxy, 30)
        self.decode.stop()
        self.prefill.stop()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        dead = self.exited()
        self.stop()
        if exc is not None and dead:
            raise UnavailableError("vllm-pd failed while serving: " + "\n".join(dead)) from exc


def _pythonpath() -> str:
    """This checkout first on the path, so ``python -m bench.vllm_pd`` finds this module."""
    return os.pathsep.join(filter(None, (str(_REPO), os.environ.get("PYTHONPATH"))))


def main(argv: list[str] | None = None) -> None:
    """The proxy; or, with ``--vllm ARGS...`` first, vLLM's CLI (``vllm ARGS...``,
    ``adapter.run_cli``) in this process (see :data:`NO_PROGRESS_THREAD_ENV`)."""
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["--vllm"]:
        from hybridpd.engine.vllm.adapter import run_cli

        run_cli(args_in[1:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--prefill", required=True, help="the prefill vllm serve's base URL")
    ap.add_argument("--decode", required=True, help="the decode vllm serve's base URL")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args(args_in)
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    uvicorn.run(make_app(args.prefill, args.decode), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
