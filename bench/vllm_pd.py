# Over 350 lines: vLLM's own P/D as a baseline: two servers, the proxy, their lifecycle.
"""vLLM's own prefill/decode disaggregation: the ``vllm-pd`` baseline.

What a user would run instead of hybridpd to split prefill from decode with
vLLM alone: two ``vllm serve`` processes (the same model and flags as
``vllm-direct``: :func:`bench.vllm_direct.serve_argv`), both with
``--kv-transfer-config`` :data:`KV_TRANSFER_CONFIG` (vLLM's NixlConnector,
``kv_both``, KV staged in host memory) and each with its own NIXL side-channel
port, and a small proxy in front of them (this module, ``python -m
bench.vllm_pd --prefill URL --decode URL --port P``; the shape of vLLM's
``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``, written
here). It is a benchmark baseline, not part of hybridpd.

The proxy, per ``/v1/completions`` or ``/v1/chat/completions`` request:

1. sends it to the prefill server as a one-token, non-streaming request
   (:func:`prefill_body`: ``max_tokens`` 1, ``stream`` off, no
   ``stream_options`` / ``min_tokens``) with ``kv_transfer_params``
   :data:`PREFILL_KV_PARAMS` (``do_remote_decode``: the prefill server computes
   the prompt, samples one token and keeps the prompt's blocks for a decode
   server to pull);
2. sends the client's request unchanged to the decode server, plus the
   ``kv_transfer_params`` the prefill response returned (:func:`decode_body`:
   ``do_remote_prefill``, the prefill engine's id, side channel and block ids):
   the decode server pulls the KV and recurrent state over NIXL, recomputes
   the last prompt token and decodes;
3. returns the decode server's response unchanged (streamed as it comes when
   the client asked for a stream), with ``X-Request-Id`` and
   :data:`PREFILL_CACHED_HEADER` (the prefill response's
   ``usage.prompt_tokens_details.cached_tokens``) added as headers.

Both requests carry the same ``X-Request-Id`` (the client's, else a new one),
which vLLM takes as its request id, so the two servers' logs pair up. An error
status from either server is returned as it came; an unreachable server is a
502 naming it. ``/tokenize`` and ``/detokenize`` go to the prefill server,
``/v1/models`` to the decode server; ``/health`` is 200 only when both are.

**``usage.prompt_tokens_details.cached_tokens`` through the proxy** is the
*prefill* server's prefix-cache hit, i.e. the prompt tokens the prefill did not
compute, which is what a user calls the hit and what ``vllm-direct`` reports.
The proxy need not rewrite anything for it: vLLM 0.32 does it itself. The
prefill server's scheduler adds ``remote_prefill_cached_tokens`` (its own
``prefill_stats.num_cached_tokens``) to the ``kv_transfer_params`` it returns
(``Scheduler.update_from_output``), and the decode server's output processor
reports that number as the request's cached tokens when a request comes with
``do_remote_prefill`` (``OutputProcessor``: ``remote_prefill_cached_tokens``),
instead of its own count, which would be nearly the whole prompt (the tokens
it pulled over NIXL count as "computed" there). :data:`PREFILL_CACHED_HEADER`
carries the prefill response's own usage figure beside it, so a test can check
the two agree (tests/vllm/test_vllm_pd.py does).

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
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from bench.vllm_direct import KV_CACHE_GIB, VllmServer, interrupt, log_tail, tiny_model
from hybridpd.errors import UnavailableError
from hybridpd.procs import free_port, listen_ports, split_cpus

logger = logging.getLogger("bench.vllm_pd")

#: both servers' KV connector: vLLM's NixlConnector in either role, buffers in host memory
KV_TRANSFER_CONFIG: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}

#: the prefill request's ``kv_transfer_params``: prefill here, a remote engine decodes
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

#: request fields the one-token prefill request leaves out (streaming options, and
#: minimum lengths a one-token request cannot meet; the decode request keeps them)
PREFILL_DROPS = ("stream_options", "min_tokens", "min_completion_tokens")

#: response header: the prefill response's ``usage.prompt_tokens_details.cached_tokens``
PREFILL_CACHED_HEADER = "x-prefill-cached-tokens"

#: the OpenAI endpoints split into a prefill and a decode request
PD_PATHS = ("/v1/completions", "/v1/chat/completions")

#: set (to "1") in a server's environment: importing this module turns NIXL's UCX
#: progress thread off (see the module doc); vLLM's processes import it as their main module
NO_PROGRESS_THREAD_ENV = "HYBRIDPD_VLLM_PD_NO_NIXL_PROGRESS_THREAD"

_REPO = Path(__file__).resolve().parent.parent

if os.environ.get(NO_PROGRESS_THREAD_ENV) == "1":
    from hybridpd.engine.vllm.patches import nixl_without_progress_thread

    nixl_without_progress_thread()


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill server's request for the client's ``body``."""
    out = {k: v for k, v in body.items() if k not in PREFILL_DROPS}
    out["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: Mapping[str, Any], params: Mapping[str, Any] | None) -> dict[str, Any]:
    """The decode server's request: the client's ``body`` with the prefill's
    ``kv_transfer_params`` (without them, as when the prefill returned none, the
    decode server computes the prompt itself)."""
    out = dict(body)
    out.pop("kv_transfer_params", None)
    if params:
        out["kv_transfer_params"] = dict(params)
    return out


def prefill_cached_tokens(response: Mapping[str, Any]) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a (non-streaming) response."""
    details = (response.get("usage") or {}).get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return cached if isinstance(cached, int) else None


def make_app(prefill: str, decode: str, transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """The proxy between a client and the ``prefill`` and ``decode`` servers (base
    URLs); ``transport``: the backends' HTTP transport (tests)."""
    client = httpx.AsyncClient(
        timeout=None,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        transport=transport,
    )
    servers = {"prefill": prefill.rstrip("/"), "decode": decode.rstrip("/")}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(lifespan=lifespan)

    def unreachable(role: str, exc: Exception) -> Response:
        message = "vllm-pd proxy: the %s server (%s) is unreachable: %r" % (role, servers[role], exc)
        logger.error("%s", message)
        return JSONResponse({"error": {"message": message, "type": "BadGateway", "code": 502}}, status_code=502)

    def relay(resp: httpx.Response, headers: Mapping[str, str] | None = None) -> Response:
        return Response(resp.content, resp.status_code, headers=headers, media_type=resp.headers.get("content-type"))

    async def split(request: Request) -> Response:
        body = await request.json()
        rid = request.headers.get("x-request-id") or "pd-" + uuid.uuid4().hex
        headers = {"X-Request-Id": rid}
        if "authorization" in request.headers:
            headers["Authorization"] = request.headers["authorization"]
        path = request.url.path
        try:
            pre = await client.post(servers["prefill"] + path, json=prefill_body(body), headers=headers)
        except httpx.HTTPError as exc:
            return unreachable("prefill", exc)
        if pre.status_code != 200:
            return relay(pre, {"X-Request-Id": rid})
        got = pre.json()
        params = got.get("kv_transfer_params")
        if not params:
            logger.warning("%s: the prefill returned no kv_transfer_params; decode computes the prompt", rid)
        out_headers = {"X-Request-Id": rid}
        cached = prefill_cached_tokens(got)
        if cached is not None:
            out_headers[PREFILL_CACHED_HEADER] = str(cached)
        req = client.build_request("POST", servers["decode"] + path, json=decode_body(body, params), headers=headers)
        try:
            resp = await client.send(req, stream=True)
        except httpx.HTTPError as exc:
            return unreachable("decode", exc)
        if not body.get("stream"):
            try:
                await resp.aread()
            finally:
                await resp.aclose()
            return relay(resp, out_headers)
        return StreamingResponse(
            resp.aiter_bytes(),
            resp.status_code,
            headers=out_headers,
            media_type=resp.headers.get("content-type"),
            background=BackgroundTask(resp.aclose),
        )

    async def forward(role: str, request: Request) -> Response:
        try:
            resp = await client.request(
                request.method,
                servers[role] + request.url.path,
                content=await request.body(),
                headers={"content-type": request.headers.get("content-type", "application/json")},
            )
        except httpx.HTTPError as exc:
            return unreachable(role, exc)
        return relay(resp)

    async def to_prefill(request: Request) -> Response:
        return await forward("prefill", request)

    async def to_decode(request: Request) -> Response:
        return await forward("decode", request)

    for path in PD_PATHS:
        app.add_api_route(path, split, methods=["POST"])
    for path in ("/tokenize", "/detokenize"):
        app.add_api_route(path, to_prefill, methods=["POST"])
    app.add_api_route("/v1/models", to_decode, methods=["GET"])

    @app.get("/health")
    async def health() -> Response:
        down = {}
        for role, url in servers.items():
            try:
                status = (await client.get(url + "/health", timeout=5)).status_code
            except httpx.HTTPError as exc:
                down[role] = repr(exc)
                continue
            if status != 200:
                down[role] = "status %d" % status
        return JSONResponse({"down": down}, status_code=503 if down else 200)

    return app


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
                os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(KV_CACHE_GIB)),
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
                self.proxy = subprocess.Popen(self.proxy_argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=_REPO)
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
    """The proxy; or, with ``--vllm ARGS...`` first, vLLM's CLI (``vllm ARGS...``) in
    this process (see :data:`NO_PROGRESS_THREAD_ENV`)."""
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["--vllm"]:
        from vllm.entrypoints.cli.main import main as vllm_main

        sys.argv = ["vllm", *args_in[1:]]
        vllm_main()
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
