"""API keys on HTTP and gRPC (from the config and from a file read again when it
changes), operator keys (the operator surface, /metrics with metrics_need_key, the
hybridpd_* usage details), and tenants that never share a prefix."""

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
from tests.wait import Pending, wait_until

OPERATOR = "op-key-1"


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = Path(tmp_path_factory.mktemp("keys")) / "api-keys"
    path.write_text("# the clients' keys\nkey-beta\n")
    return path


@pytest.fixture(scope="module")
def astack(tmp_path_factory: pytest.TempPathFactory, keys_file: Path) -> Iterator[Stack]:
    flags = ["--api-keys", "key-alpha", "--api-keys-file", str(keys_file), "--operator-api-keys", OPERATOR]
    s = Stack(Path(tmp_path_factory.mktemp("auth")), [*flags, "--metrics-need-key"])
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
    assert httpx.get(astack.http + "/ready").status_code == 200
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


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": "Bearer " + key}


def test_the_operator_surface_answers_operator_keys_only(astack: Stack) -> None:
    for path in ("/v1/hybridpd/stats", "/metrics"):
        assert httpx.get(astack.http + path).status_code == 401
        denied = httpx.get(astack.http + path, headers=_bearer("key-alpha"))
        assert denied.status_code == 403 and "operator key" in denied.json()["error"]["message"]
        assert httpx.get(astack.http + path, headers=_bearer(OPERATOR)).status_code == 200
    faults = httpx.post(astack.http + "/v1/hybridpd/faults", json={}, headers=_bearer("key-beta"))
    assert faults.status_code == 403


def test_cache_details_reach_operator_keys_only(astack: Stack) -> None:
    body = {"model": "tiny", "prompt": list(prompt(80, 73)), "max_tokens": 2, "temperature": 0}
    client = httpx.post(astack.http + "/v1/completions", json=body, headers=_bearer("key-alpha")).json()["usage"]
    operator = httpx.post(astack.http + "/v1/completions", json=body, headers=_bearer(OPERATOR)).json()["usage"]
    assert "prompt_tokens_details" in client and not any(k.startswith("hybridpd_") for k in client)
    assert "hybridpd_prefix_tokens" in operator
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(astack.grpc))
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=body["prompt"]), sampling=pb.SamplingParams(max_tokens=2))
    as_client = list(stub.Generate(req, metadata=(("authorization", "Bearer key-alpha"),)))[-1].usage
    as_operator = list(stub.Generate(req, metadata=(("authorization", "Bearer " + OPERATOR),)))[-1].usage
    assert not as_client.HasField("promised_tokens") and as_operator.HasField("promised_tokens")


def test_a_keys_file_is_read_again_when_it_changes(astack: Stack, keys_file: Path) -> None:
    def status(key: str) -> int:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
        return httpx.post(astack.http + "/v1/completions", json=body, headers=_bearer(key)).status_code

    assert status("key-gamma") == 401
    keys_file.write_text("key-beta\nkey-gamma\n")  # a rotated Secret: no restart

    def gamma_in() -> bool | Pending:
        got = status("key-gamma")
        return True if got == 200 else Pending(got)

    wait_until(gamma_in, 30, 0.2, "the new key accepted")
    keys_file.write_text("key-gamma\n")
    wait_until(lambda: status("key-beta") == 401 or Pending("beta still in"), 30, 0.2, "the removed key refused")
    assert status("key-alpha") == 200  # the config's keys stay
