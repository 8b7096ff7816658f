"""Issue #50's bounds on what one client may ask, in the one request builder for both
APIs, and the order of work: a request is admitted (its choices' in-flight slots,
429) before anything of it is tokenized, and tokenizing runs in the tokenizer pool,
off the event loop. The HTTP layer counts the body on the bytes read (chunked too)
and cancels a non-streaming request whose client disconnected, aborting its work."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import replace
from typing import Any

import httpx
import pytest

from hybridpd.config import load_config
from hybridpd.errors import InvalidRequestError, OverloadedError
from hybridpd.tokenizer import ChatMessage
from hybridpd.v1 import generate_pb2 as pb
from services.router.choices import run_request
from services.router.grpc_api import GenerationServicer
from services.router.http_gate import MAX_BODY_BYTES
from services.router.metrics import RouterMetrics
from services.router.openai_api import create_app
from services.router.orchestrator import Orchestrator
from services.router.output import OutputOptions
from services.router.request_builder import ApiRequest, Sampling, build, check_bounds, check_choices
from tests.unit.fake_actors import TOK, FakeDecode, FakePrefill, clients

pytestmark = pytest.mark.unit


class SpyTokenizer(type(TOK)):  # type: ignore[misc]
    """The repo's tokenizer, recording the thread of every encode and chat render."""

    def __init__(self) -> None:
        self.__dict__.update(TOK.__dict__)
        self.threads: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.threads.append(threading.current_thread().name)
        return super().encode(text, add_special_tokens)

    def chat_prompt(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.current_thread().name)
        return super().chat_prompt(*args, **kwargs)


def _orch(decode: FakeDecode | None = None, **over: Any) -> Orchestrator:
    cfg = load_config(env={}, overrides={"max_model_len": 256, **over})
    pre, dec = clients({"prefill-0": FakePrefill("prefill-0")}, [decode or FakeDecode()])
    orch = Orchestrator(cfg, TOK, "m", None, pre, dec, RouterMetrics())
    orch.tokenizer = SpyTokenizer()
    return orch


def _api(**fields: Any) -> ApiRequest:
    return replace(ApiRequest("r1", "tiny", Sampling(max_tokens=4)), **fields)


def test_every_bound_is_a_400_naming_its_field_before_anything_is_tokenized() -> None:
    orch = _orch(max_stop_strings=2, max_stop_chars=5, max_prompt_chars=20, max_messages=2)
    cfg = orch.cfg
    bad = {
        "stop: at most 2 stop strings, got 3": _api(text="hi", output=OutputOptions(stop=("a", "b", "c"))),
        "stop: at most 5 characters a stop string, got 6": _api(text="hi", output=OutputOptions(stop=("abcdef",))),
        "prompt: at most 20 characters, got 21": _api(text="x" * 21),
        "messages: at most 2, got 3": _api(messages=(ChatMessage("user", "a"),) * 3),
        "messages: at most 20 characters in all, got 22": _api(messages=(ChatMessage("user", "x" * 11),) * 2),
        "bad_words: at most 64 words": _api(text="hi", sampling=Sampling(bad_words=("w",) * 65)),
        "logit_bias: at most 300 tokens": _api(text="hi", sampling=Sampling(logit_bias=((1, 1.0),) * 301)),
        "request_id longer than 128": _api(text="hi", client_id="r" * 129),
    }
    for message, api in bad.items():
        with pytest.raises(InvalidRequestError, match=message.replace("(", r"\(")):
            build(api, orch, "tiny")
    assert orch.tokenizer.threads == []  # refused before tokenizing
    ok = _api(text="x" * 20, output=OutputOptions(stop=("abcde", "b")))
    check_bounds(ok, cfg)
    check_bounds(_api(messages=(ChatMessage("user", "x" * 10),) * 2), cfg)
    assert build(ok, orch, "tiny").request.prompt_token_ids == tuple(TOK.encode("x" * 20))


def test_choices_are_bounded_by_max_choices_and_the_inflight_limit() -> None:
    cfg = load_config(env={}, overrides={"max_choices": 6})
    check_choices(2, 3, cfg)
    with pytest.raises(InvalidRequestError, match=r"n: at most 6 choices per request \(prompts x n\), got 8"):
        check_choices(2, 4, cfg)
    small = load_config(env={}, overrides={"max_inflight_requests": 4})  # each choice holds a slot
    with pytest.raises(InvalidRequestError, match="at most 4 choices"):
        check_choices(1, 5, small)


def test_tickets_hold_a_slot_per_choice_until_released_once() -> None:
    adm = _orch(max_inflight_requests=4).admission
    t3 = adm.enter(3)
    with pytest.raises(OverloadedError):
        adm.enter(2)
    t1 = adm.enter(1)
    assert adm.inflight == 4
    adm.release(t3)
    adm.release(t3)  # a second release changes nothing
    assert adm.inflight == 1
    adm.release(t1)
    assert adm.inflight == 0


async def _drain(orch: Orchestrator, apis: list[ApiRequest], n: int = 1) -> list[Any]:
    return [x async for x in run_request(orch, apis, n, "test", "tiny")]


def test_a_full_router_refuses_before_tokenizing_and_builds_off_the_event_loop() -> None:
    orch = _orch(max_inflight_requests=2)
    held = orch.admission.enter(2)
    with pytest.raises(OverloadedError):
        asyncio.run(_drain(orch, [_api(text="hello there")]))
    assert orch.tokenizer.threads == [] and orch.admission.inflight == 2
    orch.admission.release(held)
    got = asyncio.run(_drain(orch, [_api(text="hello there"), _api(messages=(ChatMessage("user", "hi"),))]))
    assert {i for i, _ in got} == {0, 1} and all(ev.finished for _, ev in got if ev.usage is not None)
    loop_thread = threading.current_thread().name
    assert orch.tokenizer.threads and all(t.startswith("hybridpd-tokenizer") for t in orch.tokenizer.threads)
    assert loop_thread not in orch.tokenizer.threads
    assert orch.admission.inflight == 0 and not orch.running
    with pytest.raises(InvalidRequestError, match="stop"):  # a refused build releases its slots too
        asyncio.run(_drain(orch, [_api(text="hi", output=OutputOptions(stop=("s",) * 5))]))
    assert orch.admission.inflight == 0


def test_grpc_bounds_are_the_same_builder_s() -> None:
    orch = _orch()
    servicer = GenerationServicer(orch, "tiny")
    many = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(stop=["a"] * 5))
    long = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(stop=["a" * 257]))
    lots = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(n=17, temperature=1.0))
    for msg, match in ((many, "stop strings"), (long, "characters a stop string"), (lots, "choices")):
        with pytest.raises(InvalidRequestError, match=match):
            asyncio.run(_drain(orch, [servicer._request(msg)], msg.sampling.n or 1))
    assert orch.admission.inflight == 0


# -- the HTTP layer, in process ---------------------------------------------------------------
async def _stats() -> dict:
    return {}


def _client(orch: Orchestrator) -> httpx.AsyncClient:
    app = create_app(orch, "tiny", _stats)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")


def test_body_size_is_counted_on_the_bytes_read_chunked_too() -> None:
    orch = _orch()
    body = json.dumps({"model": "tiny", "prompt": "x" * (MAX_BODY_BYTES + 10), "max_tokens": 2}).encode()

    async def chunks() -> Any:
        for i in range(0, len(body), 1 << 20):
            yield body[i : i + (1 << 20)]

    async def go() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with _client(orch) as c:
            chunked = await c.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
            sized = await c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            small = await c.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 2})
        return chunked, sized, small

    chunked, sized, small = asyncio.run(go())
    assert "content-length" not in chunked.request.headers
    assert chunked.status_code == sized.status_code == 413, (chunked.text, sized.text)
    assert "over 8388608 bytes" in chunked.json()["error"]["message"]
    assert small.status_code == 200, small.text
    assert len(orch.tokenizer.threads) == 1  # the small one's prompt: the refused bodies reached no handler


def test_a_non_streaming_request_is_aborted_when_its_client_disconnects() -> None:
    decode = FakeDecode(stall_after=1)  # the request would run for a minute
    orch = _orch(decode)
    app = create_app(orch, "tiny", _stats)
    body = json.dumps({"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 30}).encode()
    gone = asyncio.Event()
    sent: list[dict[str, Any]] = []

    async def go() -> None:
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/completions",
            "raw_path": b"/v1/completions",
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80),
        }
        task = asyncio.ensure_future(app(scope, receive, send))
        for _ in range(200):  # until the decode stream has stalled
            await asyncio.sleep(0.01)
            if decode.generate.calls:
                break
        await asyncio.sleep(0.05)
        assert not task.done() and orch.admission.inflight == 1
        gone.set()
        await asyncio.wait_for(task, 5)

    asyncio.run(go())
    assert orch.admission.inflight == 0 and not orch.running
    assert decode.abort.calls and orch.prefill["prefill-0"].handle.abort.calls  # type: ignore[attr-defined]
    assert orch.metrics.registry.get_sample_value(
        "hybridpd_requests_total", {"api": "completions", "status": "cancelled"}
    )
