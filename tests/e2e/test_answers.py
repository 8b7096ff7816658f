"""Answer checkpoints through the public API (issue #17): the next turn of a
chat hits the previous answer too, outputs stay equal to a monolithic
no-cache run of the same ids, and a stop-string answer is never covered.

The stack runs EAGLE on, u=16 (tests/e2e/conftest.py).
"""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from hybridpd.checkpoints import checkpoint_position
from hybridpd.tokenizer import ChatMessage
from services.router.answers import strip_stop
from tests.e2e.conftest import REPLAY, Stack
from tests.wait import wait_until

pytestmark = pytest.mark.e2e

U = 16
SYSTEM = "You are a patient tutor. Explain every idea in plain words, with one short example each time."


@pytest.fixture(scope="module")
def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=stack.http + "/v1", api_key="unused", max_retries=0)


#: the router's count of answers it sent to their prefill instance
REQUESTED = "hybridpd_answer_checkpoints_requested_total"
#: every way a prefill worker ends an answer it was sent (``services/prefill/answers.py``)
OUTCOMES = (
    "answer_checkpoints",
    "answer_checkpoints_skipped",
    "answer_checkpoints_failed",
    "answer_checkpoints_dropped",
)


def _answers_done(stack: Stack, *counters: str) -> int:
    """The prefill instances' counters (default: answer checkpoints written), summed."""
    stats = stack.stats()
    names = counters or ("answer_checkpoints",)
    return sum(int(s.get(c, 0)) for name, s in stats.items() if name.startswith("prefill") for c in names)


def _answers_requested(stack: Stack) -> int:
    """Answers the router sent to a prefill instance (it decides at the end of each
    request, before the response is returned)."""
    text = httpx.get(stack.http + "/metrics", timeout=30).text
    return int(sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(REQUESTED + " ")))


def _wait_answers(stack: Stack, target: int, timeout_s: float = 30.0) -> None:
    # the answer prefill runs after the stream ended
    wait_until(lambda: _answers_done(stack) >= target, timeout_s, 0.2, "%d answer checkpoints written" % target)


def _chat(client: OpenAI, msgs: list[dict[str, str]], **extra: object):  # type: ignore[no-untyped-def]
    return client.chat.completions.create(
        model="tiny",
        messages=msgs,  # type: ignore[arg-type]
        max_tokens=40,
        temperature=0,
        extra_body={"return_token_ids": True, "hybridpd_prefill_instance": "prefill-0", **extra},
    )


def test_next_turn_hits_the_answer_and_equals_a_no_cache_run(
    client: OpenAI,
    stack: Stack,
    reference,  # type: ignore[no-untyped-def]
) -> None:
    run, tok = reference
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a recurrent state?"}]
    p1 = tok.chat_prompt([ChatMessage(**m) for m in turn1])
    before = _answers_done(stack)
    first = _chat(client, turn1)
    gen = list(first.choices[0].token_ids)  # type: ignore[attr-defined]
    assert first.choices[0].finish_reason in ("stop", "length")
    _wait_answers(stack, before + 1)
    turn2 = [
        *turn1,
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "Give me another example, please."},
    ]
    # the ids the router builds: the generated ids stand for the answer's text
    head = tuple(p1.ids) + strip_stop(gen, tok.stop_token_ids)
    ids2 = tok.chat_prompt([ChatMessage(**m) for m in turn2], recall=lambda _text: (head, len(p1.ids))).ids
    second = _chat(client, turn2)
    assert second.usage is not None and second.usage.prompt_tokens == len(ids2)
    answered = len(p1.ids) + len(gen)  # prompt + answer, as the answer checkpoint computed them
    shared = next((i for i, (a, b) in enumerate(zip(ids2, list(p1.ids) + gen, strict=False)) if a != b), answered)
    assert shared >= answered - 1  # at most the stop token differs from the template's end of turn
    want_hit = checkpoint_position(shared + 1, U, REPLAY)  # EAGLE on: where a plain hit is (native)
    assert want_hit > checkpoint_position(len(p1.ids), U, REPLAY)  # past the prompt: the answer is hit
    assert second.usage.prompt_tokens_details.cached_tokens == want_hit
    assert second.choices[0].token_ids == run(ids2, 40)  # type: ignore[attr-defined]
    # the store put is asynchronous
    wait_until(lambda: _answers_done(stack, "answer_checkpoint_bytes") > 0, 30, 0.2, "answer checkpoint bytes counted")


def test_answer_checkpoint_off_per_request_and_after_a_stop_string(client: OpenAI, stack: Stack) -> None:
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is attention?"}]
    before, requested = _answers_done(stack), _answers_requested(stack)
    _chat(client, turn1, hybridpd_answer_checkpoint=False)
    full = _chat(client, [*turn1[:1], {"role": "user", "content": "What is a token?"}])
    _wait_answers(stack, before + 1)
    text = full.choices[0].message.content or ""
    assert len(text) > 8
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = _chat(client, [*turn1[:1], {"role": "user", "content": "What is a token?"}], stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    # The router decided on both before their responses: what it sent is counted. Once the
    # prefill workers have ended every answer sent (written, skipped, failed or dropped), a
    # (wrongly) sent one would be among them.
    wait_until(
        lambda: _answers_done(stack, *OUTCOMES) == _answers_requested(stack),
        30,
        0.2,
        "the prefill workers to end every answer the router sent",
    )
    assert _answers_requested(stack) == requested + 1  # neither the opted-out nor the cut answer
    assert _answers_done(stack) == before + 1


def _grpc_chat(stack: Stack, msgs: list[dict[str, str]]) -> tuple[list[int], str, object]:
    """One gRPC chat (greedy, 40 tokens): (generated ids, text, the final usage)."""
    import grpc

    from hybridpd.v1 import generate_pb2 as pb
    from hybridpd.v1 import generate_pb2_grpc as pb_grpc

    req = pb.GenerateRequest(
        model="tiny",
        chat=pb.ChatMessages(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in msgs]),
        sampling=pb.SamplingParams(max_tokens=40, temperature=0.0),
    )
    with grpc.insecure_channel(stack.grpc) as channel:
        out = list(pb_grpc.GenerationStub(channel).Generate(req, timeout=120))
    assert out[-1].finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    return [t for m in out for t in m.token_ids], "".join(m.text for m in out), out[-1].usage


def test_a_grpc_chat_hits_its_answer_too(stack: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    """The same product over gRPC (one request builder): a chat's answer is made
    reusable, and the next turn restores it, with outputs equal to a no-cache run."""
    run, tok = reference
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Why do models forget?"}]
    p1 = tok.chat_prompt([ChatMessage(**m) for m in turn1])
    before = _answers_done(stack)
    gen, text, usage1 = _grpc_chat(stack, turn1)
    assert usage1.prompt_tokens == len(p1.ids)  # type: ignore[attr-defined]
    assert gen == run(list(p1.ids), 40)
    _wait_answers(stack, before + 1)
    turn2 = [*turn1, {"role": "assistant", "content": text}, {"role": "user", "content": "And how do they remember?"}]
    head = tuple(p1.ids) + strip_stop(gen, tok.stop_token_ids)
    ids2 = tok.chat_prompt([ChatMessage(**m) for m in turn2], recall=lambda _text: (head, len(p1.ids))).ids
    gen2, _, usage2 = _grpc_chat(stack, turn2)
    assert usage2.prompt_tokens == len(ids2)  # type: ignore[attr-defined]
    answered = len(p1.ids) + len(gen)
    shared = next((i for i, (a, b) in enumerate(zip(ids2, list(p1.ids) + gen, strict=False)) if a != b), answered)
    assert shared >= answered - 1
    want_hit = checkpoint_position(shared + 1, U, REPLAY)
    assert want_hit > checkpoint_position(len(p1.ids), U, REPLAY)  # past the prompt: the answer is hit
    assert usage2.cached_tokens == want_hit  # type: ignore[attr-defined]
    assert gen2 == run(list(ids2), 40)
