"""Sends the multi-turn plan (``bench.multi_turn``) to a server and records each
request: the client side of ``hybridpd bench multi-turn`` (``bench.multi_turn_run``
starts the servers).

Contract: requests go one at a time, streaming (TTFT: the first chunk with a
choice); each user's next request waits until ``think_ms`` after its previous
answer ended. On our stack the router's answer counters (``/metrics``) and the
prefill actors' answer-checkpoint counters (``/v1/hybridpd/stats``) are read
around every request, so each request's deltas are its own.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import httpx

from bench.multi_turn import Plan, Workload, lcp, summarize
from bench.multi_turn_encoders import Encoders, Messages, kept_tokens
from bench.stack_stats import handoff_counters

#: sent before the plan, not recorded (first-request costs out of the first TTFT):
#: no system message, so it shares less than a unit with the plan
WARMUP: Messages = [("user", "Return the warm-up value.")]

_COUNTER = re.compile(r'^(hybridpd_answer_\w+?)_total(?:\{outcome="(\w+)"\})? (\S+)$')
#: the prefill actors' answer-checkpoint counters (``services/prefill/answers.py``)
PREFILL_COUNTERS = (
    "answer_checkpoints",
    "answer_checkpoint_tokens",
    "answer_checkpoint_bytes",
    "answer_checkpoints_dropped",
    "answer_checkpoints_skipped",
    "answer_checkpoints_failed",
    "checkpoint_exports",
    "checkpoint_export_bytes",
    "checkpoint_state_bytes",
    "checkpoint_export_failures",
)


def _send(client: httpx.Client, url: str, msgs: Messages, w: Workload) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": r, "content": c} for r, c in msgs],
        "max_tokens": w.answer_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    t0 = time.perf_counter()
    ttft = usage = None
    text: list[str] = []
    ids: list[int] | None = []
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError("chat: %s" % data["error"])
            for ch in data.get("choices") or ():
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append((ch.get("delta") or {}).get("content") or "")
                if ids is not None and "token_ids" in ch and ch["token_ids"] is not None:
                    ids.extend(ch["token_ids"])
            usage = data.get("usage") or usage
    assert usage is not None and ttft is not None, "stream without usage or tokens"
    if ids is not None and len(ids) != usage["completion_tokens"]:
        ids = None  # the server does not return token ids
    return {"usage": usage, "ttft_ms": ttft * 1e3, "text": "".join(text), "ids": ids}


def _router_counters(client: httpx.Client, url: str) -> dict[str, float]:
    """``hybridpd_answer_*_total`` from the router's /metrics, keyed ``name[:outcome]``."""
    out: dict[str, float] = {}
    for line in client.get(url + "/metrics", timeout=30).text.splitlines():
        m = _COUNTER.match(line)
        if m:
            out[m.group(1) + (":" + m.group(2) if m.group(2) else "")] = float(m.group(3))
    return out


def _prefill_counters(client: httpx.Client, url: str) -> dict[str, int]:
    """The prefill actors' answer-checkpoint counters, summed."""
    stats = client.get(url + "/v1/hybridpd/stats", timeout=60).json()
    out = dict.fromkeys(PREFILL_COUNTERS, 0)
    for name, s in stats.items():
        if name.startswith("prefill"):
            for k in PREFILL_COUNTERS:
                out[k] += int(s.get(k, 0))
    return out


def _settled(client: httpx.Client, url: str, requested: float, timeout_s: float = 30.0) -> dict[str, int]:
    """The prefill counters once every requested answer checkpoint is done (or dropped,
    skipped, failed), at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        c = _prefill_counters(client, url)
        if _pending(requested, c) <= 0 or time.monotonic() > deadline:
            return c
        time.sleep(0.2)


def _pending(requested: float, c: dict[str, int]) -> int:
    ended = sum(c[k] for k in ("answer_checkpoints", "answer_checkpoints_dropped", "answer_checkpoints_skipped"))
    return int(requested) - ended - c["answer_checkpoints_failed"]


def _delta(after: dict[str, float], before: dict[str, float], key: str) -> int:
    return int(after.get(key, 0) - before.get(key, 0))


def run_conversations(
    url: str,
    plan: Plan,
    w: Workload,
    enc: Encoders,
    native: bool,
) -> dict[str, Any]:
    """Send the plan's conversations to ``url``, round by round, one request at a
    time; per request its usage, TTFT, whether the answer's text re-tokenizes to
    other ids than were generated (``enc``; trailing stop ids stripped; and again
    with the special ids left out of the generated ones: they decode to no text),
    and on our stack (``native``) the router's answer counters' deltas and the
    answer checkpoints still pending when it was sent."""
    from tqdm import tqdm

    records: list[dict[str, Any]] = []
    history: list[Messages] = [[("system", plan.system)] for _ in range(w.users)]
    last_end = [0.0] * w.users
    round1: list[list[int]] = []
    with httpx.Client() as client:
        _send(client, url, WARMUP, w)
        rc = _router_counters(client, url) if native else {}
        start = _settled(client, url, rc.get("hybridpd_answer_checkpoints_requested", 0)) if native else {}
        bar = tqdm(total=w.users * w.rounds, desc="requests", unit="req")
        for rnd in range(1, w.rounds + 1):
            for user in range(w.users):
                msgs = [*history[user], ("user", plan.messages[user][rnd - 1])]
                time.sleep(max(0.0, last_end[user] + w.think_ms / 1e3 - time.monotonic()))
                before = _router_counters(client, url) if native else {}
                pc = _prefill_counters(client, url) if native else None
                hb = (handoff_counters(client, url) if native else None) or (0, 0)
                res = _send(client, url, msgs, w)
                last_end[user] = time.monotonic()
                after = _router_counters(client, url) if native else {}
                ha = (handoff_counters(client, url) if native else None) or (0, 0)
                u = res["usage"]
                rec: dict[str, Any] = {
                    "user": user + 1,
                    "round": rnd,
                    "prompt_tokens": u["prompt_tokens"],
                    "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                    "completion_tokens": u["completion_tokens"],
                    "ttft_ms": res["ttft_ms"],
                    "prefix_tokens": u.get("hybridpd_prefix_tokens"),
                }
                if rnd == 1:
                    ids = enc.chat_ids(msgs)
                    rec["encoded_prompt_tokens"] = len(ids)
                    rec["shared_tokens"] = max((lcp(ids, q) for q in round1), default=0)
                    round1.append(ids)
                elif enc.suffix_tokens is not None:
                    rec["suffix_tokens"] = enc.suffix_tokens(msgs)
                if res["ids"] is not None:
                    gen = list(res["ids"])
                    while gen and gen[-1] in enc.stop_ids:
                        gen.pop()
                    again = enc.text_ids(res["text"])
                    rec["retokenized_differs"] = again != gen
                    rec["retokenized_tokens"] = len(again)
                    rec["retokenized_common_prefix"] = lcp(again, gen)
                    if enc.special_ids is not None:
                        rec["special_ids_in_answer"] = sum(i in enc.special_ids for i in gen)
                        rec["retokenized_differs_nonspecial"] = again != [i for i in gen if i not in enc.special_ids]
                    rec["answer_ids"] = gen
                    if enc.decode is not None:
                        rec["answer_kept_tokens"] = kept_tokens(list(res["ids"]), enc.decode, res["text"])
                rec["answer_text"] = res["text"]
                if native:
                    rec["metric_answer_hit"] = _delta(after, before, "hybridpd_answer_tokens:hit")
                    rec["metric_answer_recomputed"] = _delta(after, before, "hybridpd_answer_tokens:recomputed")
                    rec["metric_retokenized_same"] = _delta(after, before, "hybridpd_answer_retokenized:same")
                    rec["metric_retokenized_differs"] = _delta(after, before, "hybridpd_answer_retokenized:differs")
                    assert pc is not None
                    rec["answer_checkpoints_pending_at_send"] = _pending(
                        before.get("hybridpd_answer_checkpoints_requested", 0), pc
                    )
                    # what this request's handoff read, and what it would have read whole
                    rec["handoff_bytes"] = ha[0] - hb[0]
                    rec["handoff_full_bytes"] = ha[0] - hb[0] + ha[1] - hb[1]
                records.append(rec)
                history[user] = [*msgs, ("assistant", res["text"])]
                bar.update()
        bar.close()
        out = summarize(records, w.unit)
        if native:
            rc2 = _router_counters(client, url)
            requested = rc2.get("hybridpd_answer_checkpoints_requested", 0)
            end = _settled(client, url, requested)
            out["answer_checkpoints_requested"] = int(requested - rc.get("hybridpd_answer_checkpoints_requested", 0))
            out["prefill_answer_counters"] = {k: end[k] - start[k] for k in PREFILL_COUNTERS}
    out["prompt_tokens_match_round1"] = all(
        r["encoded_prompt_tokens"] == r["prompt_tokens"] for r in records if r["round"] == 1
    )
    return out
