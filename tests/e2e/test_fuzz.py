"""Bad input on a real stack: the HTTP API fuzzed by schemathesis from our own
OpenAPI schema, the gRPC API by hypothesis-generated messages. Nothing may
return a server error; every rejection carries a message.

The stack has a short context (--max-model-len 96) so that any request the
fuzzers generate finishes quickly, and a low --max-prompt-chars so that prompts
past it are drawn; fault injection is on so that its route is fuzzed too. The
gRPC messages draw every SamplingParams field, at and past its bounds.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.generation import GenerationMode

from hybridpd.v1 import generate_pb2, generate_pb2_grpc
from tests.e2e.conftest import Stack

MAX_MODEL_LEN = 96
MAX_PROMPT_CHARS = 4096
#: examples per (operation, mode); POST routes get both modes, GET routes positive only
POST_EXAMPLES, GET_EXAMPLES, GRPC_EXAMPLES = 90, 30, 200
MIN_HTTP_CASES = 500

_FUZZ_SETTINGS = settings(
    deadline=None,
    database=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def zstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(
        Path(tmp_path_factory.mktemp("fuzz")),
        [
            *("--max-model-len", str(MAX_MODEL_LEN), "--max-prompt-chars", str(MAX_PROMPT_CHARS)),
            *("--num-prefill", "1", "--fault-injection"),
        ],
    )
    s.start()
    try:
        yield s
    finally:
        s.stop()


GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


def _serve_model(drawn: tuple[schemathesis.Case, int]) -> schemathesis.Case:
    case, pick = drawn
    if pick and isinstance(case.body, dict):
        case.body["model"] = "tiny"
    return case


def _fuzz_operation(
    op: schemathesis.APIOperation, mode: GenerationMode, base: str, session: requests.Session, seen: collections.Counter
) -> None:
    name = "%s %s %s" % (op.method.upper(), op.path, mode.value)
    n = POST_EXAMPLES if op.method.upper() == "POST" else GET_EXAMPLES

    strategy = op.as_strategy(generation_mode=mode)
    if mode is GenerationMode.POSITIVE and op.path in GENERATION_PATHS:
        # most positive cases name the served model, so they reach the engine
        strategy = st.tuples(strategy, st.integers(0, 3)).map(_serve_model)

    @settings(_FUZZ_SETTINGS, max_examples=n)
    @given(case=strategy)
    def run(case: schemathesis.Case) -> None:
        resp = case.call(base_url=base, session=session, timeout=120)
        seen[resp.status_code] += 1
        seen[name] += 1
        assert resp.status_code < 500, "%s -> %d: %s" % (case.body, resp.status_code, resp.text[:500])
        if resp.status_code >= 400:
            err = resp.json()["error"]
            assert err["message"] and err["code"] == resp.status_code, resp.text

    run()


def test_http_api_fuzz_never_5xx(zstack: Stack) -> None:
    schema = schemathesis.openapi.from_url(zstack.http + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    paths = {op.path for op in ops}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= paths, paths
    session = requests.Session()
    seen: collections.Counter = collections.Counter()  # status codes and "<op> <mode>" names
    for op in ops:
        post = op.method.upper() == "POST"
        for mode in [GenerationMode.POSITIVE, GenerationMode.NEGATIVE] if post else [GenerationMode.POSITIVE]:
            _fuzz_operation(op, mode, zstack.http, session, seen)
    statuses = {k: v for k, v in seen.items() if isinstance(k, int)}
    total = sum(statuses.values())
    print(
        "HTTP fuzz: %d cases, statuses %s, per operation %s"
        % (total, statuses, {k: v for k, v in seen.items() if isinstance(k, str)})
    )
    assert total >= MIN_HTTP_CASES
    assert statuses.get(200, 0) > 0 and sum(n for s, n in statuses.items() if 400 <= s < 500) > 0


_texts = st.text(max_size=200)
_ids = st.one_of(
    st.lists(st.integers(5, 2047), max_size=120),
    st.lists(st.one_of(st.integers(5, 2047), st.integers(0, (1 << 32) - 1)), max_size=120),
)
_chat = st.lists(
    st.builds(
        generate_pb2.ChatMessage,
        role=st.one_of(st.sampled_from(["system", "user", "assistant"]), _texts),
        content=_texts,
    ),
    max_size=4,
)
#: stop strings around the bounds (max_stop_strings 4, max_stop_chars 256): most within, some past
_stops = st.lists(st.one_of(_texts, st.integers(250, 3000).map(lambda n: "s" * n)), max_size=8)
_penalty = st.one_of(st.floats(-3, 3, width=32), st.floats(width=32))
_structured = st.one_of(
    st.builds(generate_pb2.StructuredOutput, json_object=st.booleans()),
    st.builds(generate_pb2.StructuredOutput, regex=st.sampled_from(["[ab]{1,4}", "(", "x*"])),
    st.builds(
        generate_pb2.StructuredOutput, choice=st.builds(generate_pb2.ChoiceList, choices=st.lists(_texts, max_size=3))
    ),
    st.builds(generate_pb2.StructuredOutput, json_schema=st.sampled_from(['{"type": "integer"}', "{", "[]"])),
)


@st.composite
def _sampling(draw: st.DrawFn) -> generate_pb2.SamplingParams:
    """Every field of SamplingParams: in range, at the bounds and past them."""
    s = generate_pb2.SamplingParams(
        max_tokens=draw(st.one_of(st.integers(0, 40), st.integers(0, (1 << 32) - 1))),
        temperature=draw(st.one_of(st.just(0.0), st.floats(width=32))),
        top_p=draw(st.floats(width=32)),
        top_k=draw(st.one_of(st.just(0), st.integers(0, (1 << 32) - 1))),
        seed=draw(st.integers(0, (1 << 64) - 1)),
        has_seed=draw(st.booleans()),
        stop=draw(_stops),
        ignore_eos=draw(st.booleans()),
        min_tokens=draw(st.one_of(st.just(0), st.integers(0, 50), st.integers(0, (1 << 32) - 1))),
        stop_token_ids=draw(st.lists(st.integers(0, (1 << 32) - 1), max_size=4)),
        bad_words=draw(st.lists(_texts, max_size=4)),
        allowed_token_ids=draw(st.lists(st.one_of(st.integers(0, 2047), st.integers(0, (1 << 32) - 1)), max_size=6)),
        include_stop_str_in_output=draw(st.booleans()),
        n=draw(st.one_of(st.just(0), st.integers(0, 4), st.integers(0, (1 << 32) - 1))),
    )
    s.logit_bias.update(
        draw(st.dictionaries(st.integers(0, (1 << 32) - 1), st.floats(-200, 200, width=32), max_size=6))
    )
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
        if draw(st.booleans()):
            setattr(s, name, draw(_penalty))
    if draw(st.booleans()):
        s.logprobs = draw(st.integers(0, 30))
    if draw(st.booleans()):
        s.skip_special_tokens = draw(st.booleans())
    if draw(st.integers(0, 3)) == 0:
        s.structured.CopyFrom(draw(_structured))
    return s


@st.composite
def _requests(draw: st.DrawFn) -> generate_pb2.GenerateRequest:
    msg = generate_pb2.GenerateRequest(
        request_id=draw(st.one_of(st.just(""), st.text(max_size=200))),
        model=draw(st.sampled_from(["", "tiny", "other-model"])),
        cache_salt=draw(st.one_of(st.just(""), st.text(max_size=300))),
    )
    which = draw(st.sampled_from(["text", "token_ids", "chat", None]))
    if which == "text":  # sometimes past max_prompt_chars: refused before it is tokenized
        msg.text = draw(st.one_of(_texts, st.just("word " * 1000)))
    elif which == "token_ids":
        msg.token_ids.ids.extend(draw(_ids))
    elif which == "chat":
        msg.chat.messages.extend(draw(_chat))
    if draw(st.booleans()):
        msg.sampling.CopyFrom(draw(_sampling()))
    return msg


_CLIENT_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def test_grpc_api_fuzz_never_internal(zstack: Stack) -> None:
    codes: collections.Counter[str] = collections.Counter()
    with grpc.insecure_channel(zstack.grpc) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)

        @settings(_FUZZ_SETTINGS, max_examples=GRPC_EXAMPLES)
        @given(msg=_requests())
        def run(msg: generate_pb2.GenerateRequest) -> None:
            try:
                replies = list(stub.Generate(msg, timeout=120))
            except grpc.RpcError as exc:
                codes[exc.code().name] += 1
                assert exc.code() in _CLIENT_ERRORS, "%s -> %s: %s" % (msg, exc.code(), exc.details())
                assert exc.details(), msg
                return
            codes["OK"] += 1
            final = replies[-1]
            assert final.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED, msg
            s = msg.sampling
            # accepted means valid: the server's rules, restated
            assert math.isfinite(s.temperature) and 0 <= s.temperature <= 2, msg
            assert len(s.stop) <= 4 and all(len(x) <= 256 for x in s.stop), msg
            assert (s.n or 1) <= 16 and len(msg.text) <= MAX_PROMPT_CHARS, msg
            assert final.usage.prompt_tokens + final.usage.completion_tokens <= MAX_MODEL_LEN

        run()
        found = stub.Abort(generate_pb2.AbortRequest(request_id="never-started"), timeout=30)
        assert not found.found
    print("gRPC fuzz: %s" % dict(codes))
    assert codes["OK"] > 0 and codes["INVALID_ARGUMENT"] > 0


def test_pools_are_free_after_fuzzing(zstack: Stack) -> None:
    zstack.wait_all_free()
    assert httpx.get(zstack.http + "/health", timeout=10).status_code == 200
