"""vLLM's own P/D baseline (bench/vllm_pd.py): the proxy against fake prefill and
decode servers, and the two ``vllm serve`` command lines, without vLLM."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from bench import vllm_pd
from bench.vllm_direct import SHARED_PREFIX_FLAG, VllmServer, serve_argv
from bench.vllm_pd import KV_TRANSFER_CONFIG, NO_PROGRESS_THREAD_ENV, VllmPd, split_cpus
from bench.vllm_pd_proxy import PREFILL_CACHED_HEADER, PREFILL_KV_PARAMS, decode_body, make_app, prefill_body
from hybridpd.errors import UnavailableError

PREFILL, DECODE = "http://prefill.test", "http://decode.test"
#: what the fake prefill returns: vLLM 0.32's NixlConnector fields (abridged)
PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "engine-p",
    "remote_request_id": "r",
    "remote_block_ids": [[1, 2, 3]],
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "remote_prefill_cached_tokens": 32,
}
SSE = (
    b'data: {"choices":[{"index":0,"text":"a","token_ids":[7]}]}\n\n'
    b'data: {"choices":[{"index":0,"text":"b","token_ids":[9]}]}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":2,'
    b'"prompt_tokens_details":{"cached_tokens":32}}}\n\n'
    b"data: [DONE]\n\n"
)
FINAL = {"choices": [{"index": 0, "text": "ab", "token_ids": [7, 9]}], "usage": {"prompt_tokens": 40}}


class Backends:
    """Fake prefill and decode servers behind one transport; records every request."""

    def __init__(self, prefill_status: int = 200, decode_down: bool = False, prefill_health: int = 200) -> None:
        self.calls: list[tuple[str, str, dict[str, Any] | None, httpx.Headers]] = []
        self.prefill_status = prefill_status
        self.decode_down = decode_down
        self.prefill_health = prefill_health

    def __call__(self, request: httpx.Request) -> httpx.Response:
        role = "prefill" if request.url.host == "prefill.test" else "decode"
        body = json.loads(request.content) if request.content else None
        self.calls.append((role, request.url.path, body, request.headers))
        if role == "decode" and self.decode_down:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/health":
            return httpx.Response(self.prefill_health if role == "prefill" else 200)
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": [1, 2], "count": 2, "from": role})
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}], "from": role})
        if role == "prefill":
            if self.prefill_status != 200:
                return httpx.Response(self.prefill_status, json={"error": {"message": "prompt too long"}})
            usage = {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}
            return httpx.Response(200, json={"choices": [{"text": "a"}], "usage": usage, "kv_transfer_params": PARAMS})
        if body and body.get("stream"):
            return httpx.Response(200, content=SSE, headers={"content-type": "text/event-stream; charset=utf-8"})
        return httpx.Response(200, json=FINAL)

    def bodies(self, role: str) -> list[dict[str, Any]]:
        return [b for r, p, b, _ in self.calls if r == role and p.startswith("/v1/") and b is not None]


def client(backends: Backends) -> TestClient:
    return TestClient(make_app(PREFILL, DECODE, transport=httpx.MockTransport(backends)))


def test_prefill_body_asks_for_one_token_and_a_remote_decode() -> None:
    body = {
        "model": "tiny",
        "prompt": [1, 2, 3],
        "max_tokens": 8,
        "max_completion_tokens": 8,
        "min_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    got = prefill_body(body)
    assert got["max_tokens"] == 1 and got["max_completion_tokens"] == 1 and got["stream"] is False
    assert "stream_options" not in got and "min_tokens" not in got
    assert got["kv_transfer_params"] == PREFILL_KV_PARAMS and got["kv_transfer_params"]["do_remote_decode"] is True
    assert got["prompt"] == [1, 2, 3] and got["ignore_eos"] is True
    assert body["max_tokens"] == 8 and "kv_transfer_params" not in body  # the client's body is untouched
    dec = decode_body(body, PARAMS)
    assert dec == {**body, "kv_transfer_params": PARAMS}
    assert decode_body({**body, "kv_transfer_params": {"x": 1}}, None) == body  # no params: decode computes


def test_streaming_completion_goes_prefill_then_decode_and_streams_decode_unchanged() -> None:
    be = Backends()
    body = {
        "model": "tiny",
        "prompt": [5] * 40,
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    resp = client(be).post("/v1/completions", json=body)
    assert resp.status_code == 200
    assert resp.content == SSE  # the decode server's stream, byte for byte
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers[PREFILL_CACHED_HEADER] == "32"
    (pre,), (dec,) = be.bodies("prefill"), be.bodies("decode")
    assert pre["max_tokens"] == 1 and pre["stream"] is False and pre["kv_transfer_params"]["do_remote_decode"]
    assert dec == {**body, "kv_transfer_params": PARAMS}
    rids = {h["x-request-id"] for _, p, _, h in be.calls if p == "/v1/completions"}
    assert len(rids) == 1 and resp.headers["x-request-id"] in rids  # one id for both requests (vLLM's logs pair)


def test_non_streaming_chat_returns_decode_json_and_keeps_the_clients_request_id() -> None:
    be = Backends()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    resp = client(be).post("/v1/chat/completions", json=body, headers={"X-Request-Id": "mine"})
    assert resp.status_code == 200 and resp.json() == FINAL
    assert [(r, p, h["x-request-id"]) for r, p, _, h in be.calls] == [
        ("prefill", "/v1/chat/completions", "mine"),
        ("decode", "/v1/chat/completions", "mine"),
    ]
    assert be.bodies("decode")[0]["kv_transfer_params"] == PARAMS


def test_prefill_error_is_returned_as_is_and_decode_not_asked() -> None:
    be = Backends(prefill_status=400)
    resp = client(be).post("/v1/completions", json={"model": "tiny", "prompt": [1], "max_tokens": 2})
    assert resp.status_code == 400 and resp.json()["error"]["message"] == "prompt too long"
    assert not be.bodies("decode")


def test_unreachable_decode_is_a_502_naming_it() -> None:
    resp = client(Backends(decode_down=True)).post("/v1/completions", json={"model": "tiny", "prompt": [1]})
    assert resp.status_code == 502
    assert "decode server (%s)" % DECODE in resp.json()["error"]["message"]


def test_tokenize_goes_to_prefill_models_to_decode_health_needs_both() -> None:
    be = Backends()
    c = client(be)
    assert c.post("/tokenize", json={"model": "tiny", "prompt": "x"}).json()["from"] == "prefill"
    assert be.calls[-1][2] == {"model": "tiny", "prompt": "x"}
    assert c.get("/v1/models").json()["from"] == "decode"
    assert c.get("/health").status_code == 200
    down = client(Backends(prefill_health=500)).get("/health")
    assert down.status_code == 503 and "prefill" in down.json()["down"]


def test_servers_are_vllm_direct_plus_nixl_with_their_own_side_channels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vllm_pd, "tiny_model", lambda venv: Path("/models/tiny"))
    kv = ["--kv-transfer-config", json.dumps(KV_TRANSFER_CONFIG)]
    for thread in (False, True):
        pd = VllmPd(tmp_path, tmp_path, 16, 4096, nixl_progress_thread=thread)
        for srv in (pd.prefill, pd.decode):
            base = serve_argv(tmp_path, "/models/tiny", srv.port, 16, 4096)
            assert SHARED_PREFIX_FLAG in base and "--mamba-cache-mode" in base
            assert srv.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
            if thread:  # vllm serve as it ships
                assert srv.argv == [*base, *kv] and NO_PROGRESS_THREAD_ENV not in srv.env
            else:  # the same arguments to vLLM's CLI through bench.vllm_pd, progress thread off
                launcher = [str(tmp_path / "bin" / "python"), "-m", "bench.vllm_pd", "--vllm"]
                assert srv.argv == [*launcher, *base[1:], *kv] and srv.env[NO_PROGRESS_THREAD_ENV] == "1"
        assert pd.prefill.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] != pd.decode.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]
        binds = [pd.prefill.env["VLLM_CPU_OMP_THREADS_BIND"], pd.decode.env["VLLM_CPU_OMP_THREADS_BIND"]]
        assert binds == [",".join(map(str, c)) for c in split_cpus(sorted(os.sched_getaffinity(0)))]
        assert len({pd.prefill.port, pd.decode.port, pd.port}) == 3
        assert pd.proxy_argv[1:] == [
            "-m",
            "bench.vllm_pd",
            "--prefill",
            pd.prefill.http,
            "--decode",
            pd.decode.http,
            "--port",
            str(pd.port),
        ]
        assert ("progress thread off" in pd.describe()) is not thread
    direct = VllmServer(tmp_path, tmp_path, 16, 4096, model="/models/tiny")
    assert direct.argv == serve_argv(tmp_path, "/models/tiny", direct.port, 16, 4096)  # vllm-direct: no connector


def test_split_cpus_gives_each_server_its_own_half() -> None:
    assert split_cpus([0, 1]) == ([0], [1])
    assert split_cpus([0, 1, 2, 3, 4]) == ([0, 1], [2, 3, 4])
    assert split_cpus([3]) == ([3], [3])


def test_a_server_that_dies_at_start_fails_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_pd, "tiny_model", lambda venv: Path("/models/tiny"))
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "vllm"
    fake.write_text('#!/bin/sh\necho "no such model: $2"\nexit 3\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    pd = VllmPd(tmp_path, tmp_path, 16, 4096, nixl_progress_thread=True, start_timeout_s=60)
    with pytest.raises(UnavailableError) as err, pd:
        pass
    assert "vllm serve exited (status 3)" in str(err.value) and "no such model: /models/tiny" in str(err.value)
    assert pd.proxy is not None and pd.proxy.poll() is not None  # the proxy was stopped too


def test_a_launcher_that_cannot_start_stops_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_pd, "tiny_model", lambda venv: Path("/models/tiny"))
    pd = VllmPd(tmp_path, tmp_path, 16, 4096)  # tmp_path/bin/python does not exist
    with pytest.raises(UnavailableError, match="did not start"), pd:
        pass
    assert pd.proxy is None
