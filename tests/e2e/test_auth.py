"""API keys on HTTP and gRPC, and tenants that never share a prefix."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from openai import AuthenticationError, OpenAI

from hybridpd.auth import ApiKeys, tenant_id
from hybridpd.v1 import generate_pb2 as pb
from hybridpd.v1 import generate_pb2_grpc as pb_grpc
from tests.e2e.conftest import Stack
from tests.unit.engine_helpers import prompt


@pytest.fixture(scope="module")
def astack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(Path(tmp_path_factory.mktemp("auth")), ["--api-keys", "key-alpha,key-beta"])
    s.start()
    try:
        yield s
    finally:
        s.stop()


def _client(stack: Stack, key: str) -> OpenAI:
    return OpenAI(base_url=stack.http + "/v1", api_key=key, max_retries=0)


def test_http_requires_a_valid_key(astack: Stack) -> None:
    with pytest.raises(AuthenticationError):
        _client(astack, "wrong").completions.create(model="tiny", prompt="hi", max_tokens=2)
    r = httpx.post(astack.http + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert (
        r.status_code == 401 and r.headers["www-authenticate"] == "Bearer" and "API key" in r.json()["error"]["message"]
    )
    assert httpx.get(astack.http + "/health").status_code == 200  # probes stay open
    assert httpx.get(astack.http + "/metrics").status_code == 200
    ok = _client(astack, "key-alpha").completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens == 2


def test_tenants_never_share_prefixes(astack: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    run, _ = reference
    base = list(prompt(300, 71))
    ext = base + list(prompt(40, 72))

    def go(key: str, tokens: list[int], salt: str | None = None):  # type: ignore[no-untyped-def]
        extra: dict = {"return_token_ids": True}
        if salt:
            extra["cache_salt"] = salt
        return _client(astack, key).completions.create(
            model="tiny", prompt=tokens, max_tokens=4, temperature=0, extra_body=extra
        )

    go("key-alpha", base, "shared")
    # the checkpoint is put in the store and published asynchronously: wait until alpha's is
    astack.wait_store_hit(ext, cache_salt=ApiKeys.salt(tenant_id("key-alpha"), "shared"))
    other = go("key-beta", ext, "shared")  # same client salt, other tenant: no hit
    same = go("key-alpha", ext, "shared")
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert same.usage.prompt_tokens_details.cached_tokens > 0
    want = run(ext, 4)
    assert other.choices[0].token_ids == want and same.choices[0].token_ids == want  # type: ignore[attr-defined]


def test_grpc_requires_a_valid_key(astack: Stack) -> None:
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(astack.grpc))
    req = pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(max_tokens=2))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(req))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(req, metadata=(("authorization", "Bearer nope"),)))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    msgs = list(stub.Generate(req, metadata=(("authorization", "Bearer key-beta"),)))
    assert msgs[-1].usage.completion_tokens == 2


def test_grpc_abort_reaches_only_the_callers_own_requests(astack: Stack) -> None:
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(astack.grpc))
    long = pb.GenerateRequest(
        request_id="shared-id", text="The delta rule", sampling=pb.SamplingParams(max_tokens=3000, ignore_eos=True)
    )
    alpha = (("authorization", "Bearer key-alpha"),)
    beta = (("authorization", "Bearer key-beta"),)
    call = stub.Generate(long, metadata=alpha, timeout=120)
    first = next(call)
    assert first.request_id == "shared-id"  # the client's id, echoed
    assert not stub.Abort(pb.AbortRequest(request_id="shared-id"), metadata=beta).found  # another key's
    assert next(call).request_id == "shared-id"  # still running
    assert stub.Abort(pb.AbortRequest(request_id="shared-id"), metadata=alpha).found
    rest = list(call)
    assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT and rest[-1].usage.completion_tokens < 3000
    astack.wait_all_free()
