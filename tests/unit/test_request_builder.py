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
        build(_api(token_ids=ids, client_id="x" * 129), orch, "tiny")
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        build(_api(token_ids=ids, cache_salt="s" * 257), orch, "tiny")


def test_chat_gets_boundaries_an_answer_plan_and_its_default() -> None:
    orch = _orch()
    chat = TOK.chat_prompt(list(MSGS))
    assert chat.boundaries
    mine = (8, chat.boundaries[0] + 3)  # one below the first boundary, one past it
    built = build(_api(messages=MSGS, checkpoints=mine), orch, "tiny")
    req = built.request
    assert req.prompt_token_ids == tuple(chat.ids) and req.sampling.max_tokens == 512 - len(chat.ids)
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
    api = servicer._request(msg, request_id="r1")
    assert api.client_id == "r1" and servicer._request(msg).request_id != "r1"  # the server's id, the client's echoed
    got = build(api, orch, "tiny")
    # what openai_api builds for {"model": "tiny", "messages": ..., "cache_salt": ..., "request_id": "r1"}
    sampling = Sampling(temperature=0.0)
    want = build(_api(messages=MSGS, cache_salt="tenant-salt", sampling=sampling, client_id="r1"), orch, "tiny")
    assert got == want
    assert got.answer is not None and got.request.checkpoints  # boundaries and the answer plan, as over HTTP


# -- the request surface's rendering and tokenizing fields -----------------------------------
def test_skip_special_tokens_keeps_them_in_the_text() -> None:
    from services.router.output import OutputOptions, OutputProcessor

    special = TOK.stop_token_ids[-1]
    ids = (*TOK.encode(" hello"), special, *TOK.encode(" world"))
    kept = OutputProcessor(TOK, OutputOptions(skip_special_tokens=False), 3, 0).push(ids, True, "length")
    skipped = OutputProcessor(TOK, OutputOptions(), 3, 0).push(ids, True, "length")
    name = TOK.token_text(special)
    assert name in kept.text and name not in skipped.text


def test_truncation_keeps_the_side_asked_for() -> None:
    orch = _orch()
    ids = tuple(range(10, 40))
    left = build(_api(token_ids=ids, truncate_prompt_tokens=5), orch, "tiny").request.prompt_token_ids
    right = build(_api(token_ids=ids, truncate_prompt_tokens=5, truncation_side="right"), orch, "tiny").request
    assert left == ids[-5:] and right.prompt_token_ids == ids[:5]
    assert build(_api(token_ids=ids, truncate_prompt_tokens=-1), orch, "tiny").request.prompt_token_ids == ids
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens"):
        build(_api(token_ids=ids, truncate_prompt_tokens=0), orch, "tiny")


def test_add_special_tokens_reaches_the_tokenizer() -> None:
    calls: list[bool] = []

    class Spy(type(TOK)):  # type: ignore[misc]
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            calls.append(add_special_tokens)
            return super().encode(text, add_special_tokens)

    orch = _orch()
    orch.tokenizer = Spy.__new__(Spy)
    orch.tokenizer.__dict__.update(TOK.__dict__)
    build(_api(text="hello there", add_special_tokens=True), orch, "tiny")
    build(_api(text="hello there"), orch, "tiny")
    assert calls == [True, False]


def test_chat_template_kwargs_reach_the_template() -> None:
    from hybridpd.tokenizer import ChatOptions

    tok = type(TOK).__new__(type(TOK))
    tok.__dict__.update(TOK.__dict__)
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    tok.template = ImmutableSandboxedEnvironment().from_string(
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if shout %}!!{% endif %}"
    )
    msgs = [ChatMessage("user", "hi")]
    assert tok.chat_prompt(msgs, ChatOptions(template_kwargs={"shout": True})).text == "hi!!"
    assert tok.chat_prompt(msgs, ChatOptions(template_kwargs={"shout": False})).text == "hi"
    with pytest.raises(InvalidRequestError, match="messages"):
        tok.chat_prompt(msgs, ChatOptions(template_kwargs={"messages": []}))


def test_continue_final_message_cuts_after_its_content() -> None:
    from hybridpd.tokenizer import ChatOptions

    msgs = [ChatMessage("user", "What is a string?"), ChatMessage("assistant", "A string is")]
    cont = TOK.chat_prompt(msgs, ChatOptions(add_generation_prompt=False, continue_final_message=True))
    whole = TOK.chat_prompt(msgs, ChatOptions(add_generation_prompt=False))
    assert cont.text.endswith("A string is") and whole.text.startswith(cont.text) and whole.text != cont.text


def test_bad_words_tokenize_as_vllm_does() -> None:
    from services.router.request_builder import bad_word_ids

    got = bad_word_ids(("hello",), TOK)
    plain, spaced = tuple(TOK.encode("hello")), tuple(TOK.encode(" hello"))
    assert got[0] == plain
    assert (spaced in got) == (spaced[0] != plain[0] and len(spaced) == len(plain))


def test_every_sampling_field_reaches_the_engine_request() -> None:
    from hybridpd.engine.base import StructuredOutput

    orch = _orch(engine="vllm")
    s = Sampling(
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.2,
        logit_bias=((7, 1.0), (3, -1.0)),
        min_tokens=2,
        stop_token_ids=(9,),
        bad_words=("hello",),
        allowed_token_ids=(12, 11),
        logprobs=3,
        structured=StructuredOutput(regex="[0-9]+"),
        min_p=0.1,
        seed=5,
    )
    sp = build(_api(token_ids=tuple(range(10, 40)), sampling=s), orch, "tiny").request.sampling
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, 0.25, 1.2)
    assert sp.logit_bias == ((3, -1.0), (7, 1.0)) and sp.min_tokens == 2 and sp.min_p == 0.1 and sp.seed == 5
    assert sp.stop_token_ids == (9,)  # vLLM adds EOS and generation_config's ids itself, as vllm serve does
    native = build(_api(token_ids=tuple(range(10, 40)), sampling=Sampling(stop_token_ids=(9,))), _orch(), "tiny")
    assert native.request.sampling.stop_token_ids == (9, *TOK.stop_token_ids)
    assert sp.bad_words[0] == tuple(TOK.encode("hello")) and sp.allowed_token_ids == (11, 12)
    assert sp.logprobs == 3 and sp.structured == StructuredOutput(regex="[0-9]+")
    with pytest.raises(InvalidRequestError, match=r"response_format / structured_outputs.*native"):
        build(_api(token_ids=tuple(range(10, 40)), sampling=s), _orch(), "tiny")


def test_tools_reach_the_template_with_tool_choice_none() -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from hybridpd.tokenizer import ChatOptions

    tok = type(TOK).__new__(type(TOK))
    tok.__dict__.update(TOK.__dict__)
    tok.template = ImmutableSandboxedEnvironment().from_string(
        "{% if tools %}{% for t in tools %}[{{ t['function']['name'] }}]{% endfor %}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    msgs = [ChatMessage("user", "hi")]
    tools = ({"type": "function", "function": {"name": "get_weather"}},)
    assert tok.chat_prompt(msgs, ChatOptions(tools=tools)).text == "[get_weather]hi"
    assert tok.chat_prompt(msgs, ChatOptions()).text == "hi"


def test_sampling_defaults_come_from_the_model_like_vllms() -> None:
    from services.router.openai_models import ChatCompletionRequest, CompletionRequest
    from services.router.openai_sampling import sampling_of

    gen = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    body = CompletionRequest.model_validate({"model": "tiny", "prompt": "x", "top_p": 0.5, "seed": -1})
    s = sampling_of(body, gen)
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty, s.seed) == (0.7, 0.5, 20, 1.05, None)
    assert sampling_of(body, {}).temperature == 1.0
    chat = ChatCompletionRequest.model_validate(
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 1, "05": 2}}
    )
    assert sampling_of(chat, {}).logit_bias == ((5, 2),)  # a repeated id keeps its last value, as a dict does
