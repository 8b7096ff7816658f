"""The one request builder (``services/router/request_builder.py``): both APIs
get the same defaults, checks, chat boundaries and answer plans."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hybridpd.config import load_config
from hybridpd.errors import InvalidRequestError, NotFoundError
from hybridpd.tokenizer import ChatMessage
from hybridpd.v1 import generate_pb2 as pb
from hybridpd.validation import validate_request
from services.router.grpc_api import GenerationServicer
from services.router.metrics import RouterMetrics
from services.router.orchestrator import Orchestrator
from services.router.request_builder import ApiRequest, Sampling, build
from tests.unit.fake_actors import TOK

pytestmark = pytest.mark.unit

SYSTEM = "You are a careful assistant who answers in one short paragraph."
MSGS = (ChatMessage("system", SYSTEM), ChatMessage("user", "What is a prefix cache?"))


def _orch(**overrides: object) -> Orchestrator:
    cfg = load_config(env={}, overrides={"max_model_len": 512, **overrides})
    return Orchestrator(cfg, TOK, "m", None, {}, {}, RouterMetrics())


def _api(**fields: object) -> ApiRequest:
    return replace(ApiRequest("r1", "tiny", Sampling()), **fields)  # type: ignore[arg-type]


def test_defaults_clamp_and_checks() -> None:
    orch = _orch()
    ids = tuple(range(10, 40))
    assert build(_api(token_ids=ids), orch, "tiny").request.sampling.max_tokens == 16
    long = tuple(range(10, 10 + 505))  # 7 tokens of context left
    assert build(_api(token_ids=long), orch, "tiny").request.sampling.max_tokens == 7
    asked = build(_api(token_ids=ids, sampling=Sampling(max_tokens=3)), orch, "tiny").request
    assert asked.sampling.max_tokens == 3 and asked.sampling.stop_token_ids == TOK.stop_token_ids
    assert build(_api(text="hello there"), orch, "tiny").request.prompt_token_ids == tuple(TOK.encode("hello there"))
    with pytest.raises(NotFoundError, match="not served"):
        build(_api(token_ids=ids, model="other"), orch, "tiny")
    with pytest.raises(InvalidRequestError, match="tokenizes to nothing"):
        build(_api(text=""), orch, "tiny")
    with pytest.raises(InvalidRequestError, match="required"):
        build(_api(), orch, "tiny")
    with pytest.raises(InvalidRequestError, match="request_id"):
        build(_api(token_ids=ids, request_id="x" * 129), orch, "tiny")
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        build(_api(token_ids=ids, cache_salt="s" * 257), orch, "tiny")


def test_chat_gets_boundaries_an_answer_plan_and_its_default() -> None:
    orch = _orch()
    chat = TOK.chat_prompt(list(MSGS))
    assert chat.boundaries
    mine = (8, chat.boundaries[0] + 3)  # one below the first boundary, one past it
    built = build(_api(messages=MSGS, checkpoints=mine), orch, "tiny")
    req = built.request
    assert req.prompt_token_ids == tuple(chat.ids) and req.sampling.max_tokens == 256
    assert req.checkpoints == tuple(sorted({*mine, *chat.boundaries}))  # merged, ascending
    validate_request(req, TOK.vocab_size, 512)  # what admission checks: ascending, at most 8
    many = tuple(range(1, 9))  # 8 of the client's own: the boundaries still go in
    merged = build(_api(messages=MSGS, checkpoints=many), orch, "tiny").request.checkpoints
    assert len(merged) == 8 and set(chat.boundaries) <= set(merged)
    with pytest.raises(InvalidRequestError, match="ascending"):
        build(_api(messages=MSGS, checkpoints=(40, 20)), orch, "tiny")
    assert built.answer is not None and built.answer.prompt_text == chat.text
    assert build(_api(messages=MSGS, answer_checkpoint=False), orch, "tiny").answer is None
    assert built.boundaries == ()  # native: merged into the checkpoints (each is free there)
    on_vllm = build(_api(messages=MSGS, checkpoints=mine), _orch(engine="vllm"), "tiny")
    assert on_vllm.request.checkpoints == mine and on_vllm.boundaries == chat.boundaries  # the dispatcher weighs them
    tail_only = build(_api(messages=MSGS), _orch(checkpoint_policy="tail-only", answer_checkpoints=False), "tiny")
    assert tail_only.request.checkpoints == () and tail_only.answer is None and tail_only.boundaries == ()
    with pytest.raises(InvalidRequestError, match="at least one message"):
        build(_api(messages=()), orch, "tiny")


def test_a_grpc_chat_builds_what_the_same_http_chat_builds() -> None:
    orch = _orch()
    servicer = GenerationServicer(orch, "tiny")
    msg = pb.GenerateRequest(
        request_id="r1",
        chat=pb.ChatMessages(messages=[pb.ChatMessage(role=m.role, content=m.content) for m in MSGS]),
        cache_salt="tenant-salt",
    )
    got = servicer._request(msg)
    # what openai_api builds for {"model": "tiny", "messages": ..., "cache_salt": ...} with no other field
    want = build(_api(messages=MSGS, cache_salt="tenant-salt", sampling=Sampling(temperature=0.0)), orch, "tiny")
    assert got == want
    assert got.answer is not None and got.request.checkpoints  # boundaries and the answer plan, as over HTTP
