"""Each prompt is hashed once, end to end: the router's chain travels with the
request (``EngineRequest.block_hashes``) through the prefill (its local hit,
a store load, the publisher's reuse count), the handoff and decode (its pins,
its sequence), the choices of an ``n`` > 1 request share their prompt's
chain, and an answer checkpoint hashes only the answer's blocks.

Every process counts the blocks it hashed (``hashing.hashed_blocks``): the
router in ``hybridpd_hashed_blocks_total`` on /metrics, each actor in its
``hashed_blocks`` stat. The requests below take each path once; the counts
must grow by exactly one hash per full block of each prompt (the router's)
and one per full block an answer added (its prefill's), nothing else.
"""

from __future__ import annotations

import httpx
from openai import OpenAI

from hybridpd.checkpoints import checkpoint_position
from tests.e2e.conftest import REPLAY, Stack
from tests.unit.engine_helpers import prompt
from tests.wait import Pending, wait_until

U = 16  # prefix_match_unit (the default)


def _router_hashed(stack: Stack) -> int:
    lines = httpx.get(stack.http + "/metrics", timeout=30).text.splitlines()
    (value,) = [float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("hybridpd_hashed_blocks_total ")]
    return int(value)


def _counts(stack: Stack) -> dict[str, int]:
    """Blocks hashed so far, per process: the router and each actor."""
    return {"router": _router_hashed(stack), **{n: int(s["hashed_blocks"]) for n, s in stack.stats().items()}}


def _settled(stack: Stack) -> dict[str, int]:
    """The counts once every pool is free and they stopped moving (background
    answer prefills of earlier tests have run)."""
    stack.wait_all_free()
    last: list[dict[str, int]] = []

    def still() -> dict[str, int] | Pending:
        now = _counts(stack)
        same = bool(last) and last[-1] == now
        last.append(now)
        return now if same else Pending(now)

    return wait_until(still, 30.0, 0.5, "the hash counts to stop moving")


def test_each_prompt_is_hashed_once_end_to_end(stack: Stack) -> None:
    client = OpenAI(base_url=stack.http + "/v1", api_key="unused", max_retries=0)

    def complete(tokens: list[int], **extra: object) -> list[int]:
        out = client.completions.create(
            model="tiny",
            prompt=tokens,
            max_tokens=6,
            temperature=0,
            extra_body={"return_token_ids": True, **extra},
        )
        return list(out.choices[0].token_ids)  # type: ignore[attr-defined]

    before = _settled(stack)
    first = list(prompt(300, 901))
    answer = complete(first, hybridpd_prefill_instance="prefill-0")  # a miss: computed, exported
    ext = first + list(prompt(45, 902))
    pos = checkpoint_position(len(first), U, REPLAY)
    assert stack.wait_store_hit(ext, pos) == pos  # (this test process hashes here: not counted)
    complete(ext, hybridpd_prefill_instance="prefill-0")  # a local hit: the publisher counts its reuse
    complete(ext, hybridpd_prefill_instance="prefill-1")  # a store load: probe, fetch, import
    nxt = first + answer + list(prompt(40, 903))
    complete(nxt)  # the next turn: decode pins the blocks it holds (a delta handoff)
    pair = list(prompt(70, 904))
    two = client.completions.create(model="tiny", prompt=pair, max_tokens=4, n=2, temperature=1.0, seed=5)
    assert len(two.choices) == 2  # two engine requests, one prompt: hashed once
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "count the blocks of this prompt once " * 8}],
        max_tokens=6,
        temperature=0,
    )
    assert chat.choices[0].finish_reason == "length" and chat.usage is not None
    # the answer checkpoint: prompt + answer on the instance that served it, at low priority
    chat_prompt, chat_answer = chat.usage.prompt_tokens, chat.usage.completion_tokens
    answer_blocks = (chat_prompt + chat_answer) // U - chat_prompt // U

    prompts = [len(first), len(ext), len(ext), len(nxt), len(pair), chat_prompt]
    want = dict(before)
    want["router"] += sum(n // U for n in prompts)

    def reached() -> dict[str, int] | Pending:
        now = _counts(stack)
        actors = sum(v - before[k] for k, v in now.items() if k != "router")
        return now if actors >= answer_blocks else Pending(now)

    wait_until(reached, 30.0, 0.2, "the answer checkpoint's prefill")
    after = _settled(stack)
    grew = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    assert after["router"] == want["router"], grew
    assert sum(v for k, v in grew.items() if k != "router") == answer_blocks, grew
