"""Branch-aware checkpoints through the public API (issue #16): prompts that
share a prefix and then diverge reuse it, the router says why a prefix
missed, and outputs stay equal to a monolithic no-cache run.

The stack runs EAGLE on, u=16, B=64, a=16 (tests/e2e/conftest.py), so every
expected position comes from the protocol's functions with this stack's
``REPLAY`` (False: the native EAGLE head replays no unit).
"""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from hybridpd.checkpoints import (
    checkpoint_position,
    extra_slot_column,
    junction_position,
    requested_checkpoints,
)
from hybridpd.prefix_outcomes import prefix_token_split
from hybridpd.tokenizer import ChatMessage
from tests.e2e.conftest import REPLAY, Stack
from tests.unit.engine_helpers import prompt

pytestmark = pytest.mark.e2e

U, B, A = 16, 64, 16


@pytest.fixture(scope="module")
def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=stack.http + "/v1", api_key="unused", max_retries=0)


def _complete(client: OpenAI, tokens: list[int], instance: str = "prefill-0"):  # type: ignore[no-untyped-def]
    return client.completions.create(
        model="tiny",
        prompt=tokens,
        max_tokens=6,
        temperature=0,
        extra_body={"return_token_ids": True, "hybridpd_prefill_instance": instance},
    )


def _split(resp) -> dict[str, int]:  # type: ignore[no-untyped-def]
    split = resp.usage.model_extra["hybridpd_prefix_tokens"]
    assert sum(split.values()) == resp.usage.prompt_tokens
    # what the index promised on the routed (here: pinned) instance, restored in full
    promised = resp.usage.model_extra["hybridpd_promised_tokens"]
    assert 0 <= promised <= resp.usage.prompt_tokens_details.cached_tokens, (promised, resp.usage)
    return dict(split)


def _prefix_metric(stack: Stack) -> dict[str, float]:
    text = httpx.get(stack.http + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("hybridpd_prefix_tokens_total{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = float(line.rsplit(" ", 1)[1])
    return out


def test_fan_out_second_request_pays_for_the_junction_every_later_one_hits(
    client: OpenAI,
    stack: Stack,
    reference,  # type: ignore[no-untyped-def]
) -> None:
    run, _ = reference
    system = list(prompt(150, 1601))  # not a unit multiple
    convs = [system + list(prompt(30, 1610 + i)) for i in range(4)]
    n = len(convs[0])
    known = len(system) // U * U  # the blocks every conversation shares: 144
    junction = junction_position(known, U, REPLAY)  # EAGLE on, no replay unit: 144
    assert junction == known - (U if REPLAY else 0) and junction < checkpoint_position(n, U, REPLAY)
    assert requested_checkpoints([known], 0, n, U, B, A, REPLAY) == (junction,)

    before = _prefix_metric(stack)
    first = _complete(client, convs[0])
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = _complete(client, convs[1])  # the index knows S's blocks, no state there: the junction
    assert second.usage.prompt_tokens_details.cached_tokens == 0
    assert _split(second) == prefix_token_split(n, U, REPLAY, hit=0, known=known, seen=known)
    assert _split(second)["checkpoint_missing"] == junction
    for conv in convs[2:]:
        got = _complete(client, conv)
        assert got.usage.prompt_tokens_details.cached_tokens == junction
        assert _split(got)["hit"] == junction
        assert got.choices[0].token_ids == run(conv, 6)  # type: ignore[attr-defined]
    after = _prefix_metric(stack)
    assert after["hit"] - before.get("hit", 0) >= 2 * junction
    assert after["checkpoint_missing"] - before.get("checkpoint_missing", 0) >= junction
    # the junction checkpoint went to MooncakeStore too: another instance loads it
    conv = system + list(prompt(30, 1620))
    assert stack.wait_store_hit(conv, junction, timeout_s=15) == junction  # put and published asynchronously
    other = _complete(client, conv, "prefill-1")
    assert other.usage.prompt_tokens_details.cached_tokens == junction
    assert other.choices[0].token_ids == run(conv, 6)  # type: ignore[attr-defined]


def test_junction_in_the_restored_slot_column_is_checkpoint_missing_and_never_promised(client: OpenAI) -> None:
    """A junction whose state would go into the slot column the restored state
    sits in cannot hold a checkpoint: counted as checkpoint_missing, and no later
    request is promised (or gets) a hit there."""
    trunk = list(prompt(340, 1701))
    base = trunk[:300]
    first = _complete(client, base)  # leaves its tail checkpoint
    tail = checkpoint_position(len(base), U, REPLAY)
    assert tail == 288 - (U if REPLAY else 0) and first.usage.prompt_tokens_details.cached_tokens == 0
    _complete(client, trunk + list(prompt(20, 1702)))  # hits the tail; its KV covers 340 tokens of the trunk
    branch = trunk[:310]  # 19 shared blocks: known 304, junction 304 (288 where EAGLE replays)
    known = len(branch) // U * U
    junction = junction_position(known, U, REPLAY)
    assert (known, junction) == (304, 304 - (U if REPLAY else 0))
    # the hit (288) restores from column (288 - 1) // 64 = 4; state@304 belongs in column 4 too
    assert extra_slot_column(junction, B) == (tail - 1) // B
    for seed in (1703, 1704, 1705):
        conv = branch + list(prompt(40, seed))
        got = _complete(client, conv)
        assert got.usage.prompt_tokens_details.cached_tokens == tail
        split = _split(got)
        assert split["hit"] == tail and split["checkpoint_missing"] == junction - tail


def test_chat_system_prompt_is_reusable_from_the_first_conversation(
    client: OpenAI,
    stack: Stack,
    reference,  # type: ignore[no-untyped-def]
) -> None:
    run, tok = reference
    system = "You are the support assistant of a delta-rule company. " * 6 + "Answer in one sentence."

    def msgs(question: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": system}, {"role": "user", "content": question}]

    questions = [
        "Where is my order? I placed it three weeks ago and the tracking page has not changed since.",
        "How do I reset my password when the reset mail never arrives in my inbox or spam folder?",
        "Do you ship to Mars, and if so, how long does delivery take and what does it cost there?",
    ]
    first_prompt = tok.chat_prompt([ChatMessage(**m) for m in msgs(questions[0])])
    ids, turns = first_prompt.ids, first_prompt.boundaries
    expected = requested_checkpoints(turns, 0, len(ids), U, B, A, REPLAY)
    # the message boundary, not the tail, is what the next conversation shares
    assert expected and expected[0] < checkpoint_position(len(ids), U, REPLAY)
    first = client.chat.completions.create(
        model="tiny",
        messages=msgs(questions[0]),  # type: ignore[arg-type]
        max_tokens=4,
        temperature=0,
        extra_body={"hybridpd_prefill_instance": "prefill-0"},
    )
    assert first.usage is not None and first.usage.prompt_tokens_details.cached_tokens == 0
    for q in questions[1:]:
        conv = [ChatMessage(**m) for m in msgs(q)]
        got = client.chat.completions.create(
            model="tiny",
            messages=msgs(q),  # type: ignore[arg-type]
            max_tokens=4,
            temperature=0,
            extra_body={"hybridpd_prefill_instance": "prefill-0"},
        )
        assert got.usage is not None
        assert got.usage.prompt_tokens_details.cached_tokens == expected[0]  # the second conversation hits
        want = run(tok.apply_chat_template(conv), 4)
        assert got.choices[0].message.content == tok.decode(want)
