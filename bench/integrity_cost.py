"""What keyed integrity adds to ``bench overhead``'s workload: ``--integrity`` (default on).

The keyed work is timed in the bench process on the workload's own objects, each
the median of ``reps`` repetitions, with and without it:

* per handoff: a prefill of ``prompt_tokens`` on the native engine offers its real
  NIXL descriptor; the prefill side tags it (every field, the ticket's metadata),
  the decode side checks the tag (``transfer/nixl_handoff.py``);
* per token frame (one output chunk): the decode actor tags it, the router's sink
  checks it (``services/worker/token_channel.py``), against the same frame's
  JSON encoding and parsing without a tag;
* per store checkpoint of the prompt (its handoff's bytes): the tag over every byte
  on the put (off the request path) and again on a hit's load.

``share_of_ttft_c1`` is the per-handoff cost over the stack's TTFT p50 at
concurrency 1, per repeat (median), against :data:`TARGET`. On the native engine
the first token leaves with the prefill, before the handoff, so that share bounds
what a request's second token pays; a end-to-end before/after of the whole serving
path is ``hybridpd bench ab --before <commit> --bench overhead``.
"""

from __future__ import annotations

import json
import random
import secrets
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridpd.engine.native.engine import NativeEngine

#: issue #51's target: keyed integrity costs at most this share of TTFT per handoff
TARGET = 0.05


def _median_us(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def measure(engine: NativeEngine, prompt_tokens: int, reps: int = 200) -> dict[str, Any]:
    """The keyed work per handoff, per token frame and per store checkpoint, in microseconds."""
    from hybridpd.engine.base import EngineRequest, RequestId, SamplingParams
    from hybridpd.engine.native.handoff import NativeTicket
    from hybridpd.integrity import HANDOFF, STORE_OBJECT, TOKEN_FRAME, IntegrityKey
    from hybridpd.transfer.nixl_handoff import check_descriptor, tag_descriptor
    from services.worker.messages import TokenChunk
    from services.worker.token_channel import decode, encode

    key = IntegrityKey(secrets.token_bytes(32))
    rid = RequestId("integrity-cost")
    rng = random.Random(51)
    prompt = tuple(rng.randrange(5, 2048) for _ in range(prompt_tokens))
    engine.add_request(EngineRequest(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True)), prefill_only=True)
    while engine.has_work():
        engine.step()
    ticket = engine.pop_handoff(rid)
    assert isinstance(ticket, NativeTicket), "the prefill left no handoff"
    try:
        desc, context = ticket.descriptor, ticket.context()
        handoff = key.tagger(HANDOFF)
        tagged = tag_descriptor(desc, handoff, context)
        tag_us = _median_us(lambda: tag_descriptor(desc, handoff, context), reps)
        check_us = _median_us(lambda: check_descriptor(tagged, handoff, context), reps)
    finally:
        engine.abort(rid)  # withdraws the offer
        while engine.has_work():
            engine.step()
    frames = key.tagger(TOKEN_FRAME)
    chunk = TokenChunk((1234,))
    keyed_us = _median_us(lambda: decode(frames, encode(frames, rid, 7, chunk), 1 << 20), reps)
    plain_us = _median_us(lambda: json.loads(json.dumps([rid, 7, list(chunk.token_ids), False, None, None])), reps)
    payload = bytes(ticket.nbytes)  # a checkpoint of the prompt: its handoff's bytes
    store_us = _median_us(lambda: key.tagger(STORE_OBJECT).tag(payload), max(reps // 10, 5))
    return {
        "handoff_bytes": ticket.nbytes,
        "handoff_tag_us": tag_us,
        "handoff_check_us": check_us,
        "per_handoff_us": tag_us + check_us,
        "frame_keyed_us": keyed_us,
        "frame_plain_us": plain_us,
        "frame_tag_us": max(keyed_us - plain_us, 0.0),
        "store_tag_us_per_checkpoint": store_us,
    }


def shares(cost: dict[str, Any], repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """``cost`` with the per-handoff share of each repeat's stack TTFT p50 at concurrency 1."""
    ttft_ms = [r["results"]["stack"]["concurrency_1"]["ttft_ms"]["p50"] for r in repeats]
    share = statistics.median(cost["per_handoff_us"] / 1000.0 / t for t in ttft_ms)
    return {**cost, "share_of_ttft_c1": share, "target": TARGET, "met": share <= TARGET}


def markdown(out: dict[str, Any]) -> list[str]:
    """The lines ``bench overhead``'s table gets for an ``integrity`` result (none without one)."""
    c = out.get("integrity")
    if not c:
        return []
    return [
        "",
        "Keyed integrity (`--integrity`, timed in-process on this workload): per handoff %.1f us (tag %.1f, check"
        " %.1f; a %d-byte handoff), %.4f of the stack's TTFT p50 at concurrency 1 (target at most %.2f: %s); per"
        " token frame %.1f us over its JSON; per store checkpoint of the prompt %.1f us each way."
        % (
            c["per_handoff_us"],
            c["handoff_tag_us"],
            c["handoff_check_us"],
            c["handoff_bytes"],
            c["share_of_ttft_c1"],
            c["target"],
            "met" if c["met"] else "missed",
            c["frame_tag_us"],
            c["store_tag_us_per_checkpoint"],
        ),
    ]
