"""vLLM's OpenAI request surface through the whole native stack (issue #49): each
honoured field changes the output as it should (greedy, against the same stack's
plain answer), n and a batch of prompts, logprobs on both endpoints, echo, the chat
rendering fields, streaming usage, and the 400s that name what is refused."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Stack

pytestmark = pytest.mark.e2e

PROMPT = 'def parse(self, text):\n    """Parse the'


def _post(stack: Stack, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(stack.http + path, json=body, timeout=120)


def _complete(stack: Stack, **fields: Any) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "return_token_ids": True, **fields}
    r = _post(stack, "/v1/completions", body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _choice(stack: Stack, **fields: Any) -> dict[str, Any]:
    ch: dict[str, Any] = _complete(stack, **fields)["choices"][0]
    return ch


def _ids(stack: Stack, text: str) -> list[int]:
    r = _post(stack, "/tokenize", {"model": "tiny", "prompt": text})
    assert r.status_code == 200, r.text
    ids: list[int] = r.json()["tokens"]
    return ids


def _first_diff(a: list[int], b: list[int]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)


def test_every_honoured_field_changes_the_output(stack: Stack) -> None:
    base = _choice(stack)
    ids, text = base["token_ids"], base["text"]
    prompt_ids = _ids(stack, PROMPT)
    assert len(ids) == 24 and base["finish_reason"] == "length"
    # penalties: output differs first where greedy repeated a token they count
    for field, seen in (
        ("presence_penalty", ids),
        ("frequency_penalty", ids),
        ("repetition_penalty", prompt_ids + ids),
    ):
        got = _choice(stack, **{field: 2.0 if field != "repetition_penalty" else 1.8})["token_ids"]
        i = _first_diff(got, ids)
        assert ids[i] in (seen[: len(prompt_ids) + i] if field == "repetition_penalty" else ids[:i]), field
    # sampling: a seed repeats, another seed differs, and each filter that keeps only the top token is greedy
    sampled = _choice(stack, temperature=1.0, seed=1)["token_ids"]
    assert sampled != ids and _choice(stack, temperature=1.0, seed=1)["token_ids"] == sampled
    assert _choice(stack, temperature=1.0, seed=2)["token_ids"] != sampled
    for keep_top in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        assert _choice(stack, temperature=1.0, seed=1, **keep_top)["token_ids"] == ids, keep_top
    # logit_bias, allowed_token_ids, bad_words
    assert set(_choice(stack, logit_bias={"777": 100})["token_ids"]) == {777}
    assert set(_choice(stack, allowed_token_ids=[ids[2], 300])["token_ids"]) <= {ids[2], 300}
    word = next(t for t in ids if _post(stack, "/detokenize", {"tokens": [t]}).json()["prompt"].strip().isalpha())
    w = _post(stack, "/detokenize", {"tokens": [word]}).json()["prompt"].strip()
    banned = _choice(stack, bad_words=[w])["token_ids"]
    assert banned != ids and not {tuple(_ids(stack, w)), tuple(_ids(stack, " " + w))} & {(t,) for t in banned}
    # stop token ids: the answer ends at the token, its text left out, the id named
    cut = _choice(stack, stop_token_ids=[ids[3]])
    assert cut["token_ids"] == ids[:4] and cut["finish_reason"] == "stop" and cut["stop_reason"] == ids[3]
    assert text.startswith(cut["text"]) and len(cut["text"]) < len(text)
    # stop strings, with and without the stop string kept
    stop = text[5:9]
    at = text.index(stop)
    assert _choice(stack, stop=[stop])["text"] == text[:at]
    kept = _choice(stack, stop=[stop], include_stop_str_in_output=True)
    assert kept["text"] == text[: at + len(stop)] and kept["stop_reason"] == stop
    # EOS: min_tokens holds it off, ignore_eos ignores it
    eos = _ids(stack, "<eos>")[0]
    assert _complete(stack, logit_bias={str(eos): 100})["usage"]["completion_tokens"] == 1
    assert _complete(stack, logit_bias={str(eos): 100}, min_tokens=5)["usage"]["completion_tokens"] == 6
    assert _complete(stack, logit_bias={str(eos): 100}, ignore_eos=True)["usage"]["completion_tokens"] == 24
    # lengths
    assert _choice(stack, max_tokens=5)["token_ids"] == ids[:5]
    assert _complete(stack, truncate_prompt_tokens=3)["usage"]["prompt_tokens"] == 3
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "What is a string?"}], "temperature": 0}
    r = _post(stack, "/v1/chat/completions", {**chat, "max_completion_tokens": 3, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 3


def test_n_choices_share_the_prompt(stack: Stack) -> None:
    long = list(range(300, 300 + 100))
    before = sum(s.get("prefill_computed_tokens", 0) for s in stack.stats().values())
    out = _complete(stack, prompt=long, n=3, max_tokens=6, temperature=1.0, seed=7)
    after = sum(s.get("prefill_computed_tokens", 0) for s in stack.stats().values())
    choices = out["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    # the prompt is computed once: each sibling computes only its tail after the prompt's checkpoint
    assert after - before <= len(long) + 2 * 16, (before, after)
    assert out["usage"]["prompt_tokens"] == len(long) and out["usage"]["completion_tokens"] == 18
    for j, c in enumerate(choices):  # sibling j samples with seed + j, as vLLM's n does
        alone = _choice(stack, prompt=long, max_tokens=6, temperature=1.0, seed=7 + j)
        assert c["token_ids"] == alone["token_ids"], j
    greedy = _post(stack, "/v1/completions", {"model": "tiny", "prompt": "x", "n": 2, "temperature": 0})
    assert greedy.status_code == 400 and "n must be 1" in greedy.json()["error"]["message"]
    # a batch of prompts: each choice as that prompt alone
    batch = _complete(stack, prompt=[PROMPT, "The delta rule"], max_tokens=6)["choices"]
    assert [c["index"] for c in batch] == [0, 1]
    assert batch[0]["token_ids"] == _choice(stack, max_tokens=6)["token_ids"]
    assert batch[1]["token_ids"] == _choice(stack, prompt="The delta rule", max_tokens=6)["token_ids"]


def test_logprobs_on_both_endpoints(stack: Stack) -> None:
    ch = _choice(stack, logprobs=2, max_tokens=6)
    lp = ch["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    for tok, val, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert top[tok] == val == max(top.values()) and 2 <= len(top) <= 3  # greedy: the sampled token leads
    assert "".join(lp["tokens"]) == ch["text"] and lp["text_offset"][0] == 0
    as_ids = _choice(stack, logprobs=0, max_tokens=6, return_tokens_as_token_ids=True)
    assert as_ids["logprobs"]["tokens"] == ["token_id:%d" % t for t in as_ids["token_ids"]]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "What is a string?"}], "temperature": 0}
    r = _post(stack, "/v1/chat/completions", {**chat, "max_tokens": 5, "logprobs": True, "top_logprobs": 3})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 5 and all(len(c["top_logprobs"]) == 3 for c in content)
    assert all(c["top_logprobs"][0]["token"] == c["token"] for c in content)
    r = _post(stack, "/v1/chat/completions", {**chat, "max_tokens": 5})
    assert r.json()["choices"][0]["logprobs"] is None
    # streaming: the same logprobs, chunk by chunk
    streamed: list[dict[str, Any]] = []
    with httpx.stream(
        "POST", stack.http + "/v1/chat/completions", json={**chat, "max_tokens": 5, "logprobs": True, "stream": True}
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"][0]
                streamed += (c.get("logprobs") or {}).get("content") or []
    assert [c["token"] for c in streamed] == [c["token"] for c in content]


def test_echo(stack: Stack) -> None:
    ch = _choice(stack, echo=True, max_tokens=4, return_token_ids=False)
    assert ch["text"] == PROMPT + _choice(stack, max_tokens=4)["text"]
    # vLLM's rule: with return_token_ids the prompt comes back as ids, not echoed text
    ids = _choice(stack, echo=True, max_tokens=4)
    assert ids["text"] == _choice(stack, max_tokens=4)["text"] and ids["prompt_token_ids"] == _ids(stack, PROMPT)
    first = ""
    with httpx.stream(
        "POST",
        stack.http + "/v1/completions",
        json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "echo": True, "stream": True},
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                first = first or json.loads(line[6:])["choices"][0]["text"]
    assert first.startswith(PROMPT)
    r = _post(stack, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "echo": True, "logprobs": 1})
    assert r.status_code == 400 and "echo" in r.json()["error"]["message"]


def test_chat_rendering_fields(stack: Stack) -> None:
    msgs = [{"role": "user", "content": "What is a string?"}, {"role": "assistant", "content": "A string is"}]
    body = {"model": "tiny", "messages": msgs, "max_tokens": 6, "temperature": 0}
    cont = {**body, "continue_final_message": True, "add_generation_prompt": False}
    tok = _post(stack, "/tokenize", {"model": "tiny", "messages": msgs, **{k: cont[k] for k in list(cont)[-2:]}})
    r = _post(stack, "/v1/chat/completions", cont)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == tok.json()["count"]
    assert tok.json()["count"] < _post(stack, "/tokenize", {"model": "tiny", "messages": msgs}).json()["count"]
    echoed = _post(stack, "/v1/chat/completions", {**cont, "echo": True}).json()["choices"][0]["message"]["content"]
    assert echoed == "A string is" + r.json()["choices"][0]["message"]["content"]
    both = _post(stack, "/v1/chat/completions", {**body, "continue_final_message": True})
    assert both.status_code == 400 and "continue_final_message" in both.json()["error"]["message"]
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "a string?"}]
    as_parts = _post(stack, "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": parts}]})
    joined = _post(
        stack, "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "What is\na string?"}]}
    )
    assert as_parts.json()["choices"][0]["message"] == joined.json()["choices"][0]["message"]


def test_usage_in_a_stream(stack: Stack) -> None:
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = []
    with httpx.stream("POST", stack.http + "/v1/completions", json={**body, "n": 2}) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert {c["choices"][0]["index"] for c in chunks[:-1]} == {0, 1}


def test_request_id_field_is_echoed_not_used(stack: Stack) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "request_id": "my-id-1"}
    r = _post(stack, "/v1/completions", body)
    assert r.status_code == 200 and r.headers["x-request-id"] == "my-id-1"  # echoed, as vLLM names it
    rid = r.json()["id"]
    assert rid.startswith("cmpl-") and rid != "cmpl-my-id-1"  # vLLM's form, with the server's own id


def test_another_model_is_404(stack: Stack) -> None:
    r = _post(stack, "/v1/completions", {"model": "other", "prompt": "x"})
    assert r.status_code == 404 and "other" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("response_format", {"type": "json_object"}),
        ("structured_outputs", {"regex": "[0-9]+"}),
        ("use_beam_search", True),
        ("prompt_logprobs", 1),
        ("tool_choice", "required"),
        ("frobnicate", 1),
    ],
)
def test_what_is_not_honoured_is_a_400_naming_it(stack: Stack, field: str, value: Any) -> None:
    for path, body in (
        ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2}),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
    ):
        extra = {field: value}
        if field == "tool_choice":
            if path == "/v1/completions":
                continue
            extra["tools"] = [{"type": "function", "function": {"name": "f"}}]
        r = _post(stack, path, {**body, **extra})
        assert r.status_code == 400, (path, field, r.text)
        msg = r.json()["error"]["message"]
        assert field in msg or (field == "structured_outputs" and "response_format / structured_outputs" in msg)


def test_grpc_takes_the_same_surface(stack: Stack) -> None:
    import grpc

    from hybridpd.v1 import generate_pb2 as pb
    from hybridpd.v1 import generate_pb2_grpc as pb_grpc

    stub = pb_grpc.GenerationStub(grpc.insecure_channel(stack.grpc))
    http = _choice(stack, max_tokens=8, logprobs=2, frequency_penalty=1.5)
    sp = pb.SamplingParams(max_tokens=8, logprobs=2, frequency_penalty=1.5)
    msgs = list(stub.Generate(pb.GenerateRequest(model="tiny", text=PROMPT, sampling=sp), timeout=120))
    assert [t for m in msgs for t in m.token_ids] == http["token_ids"]
    lps = [lp for m in msgs for lp in m.logprobs]
    assert [round(lp.logprob, 4) for lp in lps] == [round(v, 4) for v in http["logprobs"]["token_logprobs"]]
    assert all(len(lp.top) == 2 and lp.rank == 1 for lp in lps)
    # n: each choice streams with its index; choice j samples with seed + j
    two = pb.SamplingParams(max_tokens=6, temperature=1.0, seed=5, has_seed=True, n=2)
    msgs = list(stub.Generate(pb.GenerateRequest(model="tiny", text=PROMPT, sampling=two), timeout=120))
    for index in (0, 1):
        alone = _choice(stack, max_tokens=6, temperature=1.0, seed=5 + index)["token_ids"]
        assert [t for m in msgs if m.index == index for t in m.token_ids] == alone
    ids = http["token_ids"]
    stop = pb.SamplingParams(max_tokens=8, stop_token_ids=[ids[2]], frequency_penalty=1.5)
    last = list(stub.Generate(pb.GenerateRequest(model="tiny", text=PROMPT, sampling=stop), timeout=120))[-1]
    assert last.finish_reason == pb.FINISH_REASON_STOP and last.stop_token_id == ids[2]
    # a grammar the native engine cannot follow, and a field this server does not know: INVALID_ARGUMENT naming them
    bad = pb.SamplingParams(structured=pb.StructuredOutput(regex="[0-9]+"))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(model="tiny", text=PROMPT, sampling=bad), timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "structured" in (err.value.details() or "")
    raw = pb.GenerateRequest(model="tiny", text=PROMPT).SerializeToString() + bytes([0xF8, 0x06, 0x01])
    call = grpc.insecure_channel(stack.grpc).unary_stream(
        "/hybridpd.v1.Generation/Generate",
        request_serializer=lambda b: b,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as err:
        list(call(raw, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "#111" in (err.value.details() or "")
