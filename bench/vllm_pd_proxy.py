"""The ``vllm-pd`` baseline's proxy (``bench.vllm_pd``: vLLM's own prefill/decode
disaggregation): one ``/v1`` endpoint in front of a prefill and a decode
``vllm serve``, the shape of vLLM's
``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``, written here.
It runs as ``python -m bench.vllm_pd --prefill URL --decode URL --port P``.

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
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

# NOTE: named after the module the proxy runs as (``python -m bench.vllm_pd``)
logger = logging.getLogger("bench.vllm_pd")

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
