"""The multi-turn workload: LMCache's multi-round QA shape, on the chat API.

U users share one system prompt; each user's conversation grows every round
by a user message and the model's own answer of exactly A tokens
(``max_tokens: A``, ``ignore_eos``, greedy); a user sends the next round no
earlier than a think time after its previous answer ended. Requests go one
at a time, round by round (user 1..U of round 1, then of round 2, ...), so
each request's counters are its own.

What a request ideally recomputes (``ideal``):

* round r >= 2: ``prompt_tokens(r) - (prompt_tokens(r-1) + completion_tokens(r-1))``
  of the same user: the template's end of the previous answer, the new user
  message and the next generation prompt; everything before it (the previous
  prompt and the answer's ids) was computed by the engine already. Where the
  answer ends inside a character (the client got the text before it),
  ``completion_tokens(r-1)`` counts only the ids before the cut
  (``answer_kept_tokens``: what the router keeps of it);
* round 1: ``prompt_tokens`` minus the longest token prefix it shares with
  an earlier user's round-1 prompt (the system prompt's shared part; the
  first user: nothing), reported per round but not in the overall figures.

``recomputed = prompt_tokens - cached_tokens``. Tokens of the previous answer
that hit: ``clamp(cached_tokens - prompt_tokens(r-1), 0, completion_tokens(r-1))``
(from usage, every variant), beside the router's own count
(``hybridpd_answer_tokens_total{outcome}`` deltas, where the router recalled
the answer's ids). Overall figures (``variants.<name>``) count rounds >= 2.

Variants (each on a fresh ``hybridpd up``, the bundled ``tiny`` model, u = 16,
B = 64 (vLLM's align-mode column rule; the config's default is B = u), EAGLE
off): ``answers-cached`` (``answer_checkpoints: true``, the default),
``prompt-only`` (``--no-answer-checkpoints``: only prompts are checkpointed),
``nocache`` and ``vllm-direct`` (plain ``vllm serve`` of the tiny Qwen3-Next,
prefix caching at unit u; left out with a note without ``.venv-vllm``). This
module is the plan and the arithmetic, pure (``tests/unit/test_bench_multi_turn.py``);
``bench.multi_turn_checks`` judges a run on them and ``bench.multi_turn_run`` runs it.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bench.shared_prefix import WORDS, lcp

TextEncoder = Callable[[str], list[int]]

VARIANTS = ("answers-cached", "prompt-only", "nocache", "vllm-direct")


@dataclass(frozen=True, slots=True)
class Workload:
    users: int = 4
    rounds: int = 4
    system_tokens: int = 200
    message_tokens_min: int = 30
    message_tokens_max: int = 60
    answer_tokens: int = 128
    think_ms: int = 1000
    unit: int = 16
    mamba_block_size: int = 16  # the default config's (B = u)
    seed: int = 0


QUICK = Workload(users=2, rounds=3)


@dataclass(frozen=True, slots=True)
class Plan:
    system: str
    #: messages[user][round - 1]: the user's message of that round
    messages: tuple[tuple[str, ...], ...]


def _text(rng: random.Random, n_tokens: int, tokens_per_word: float, question: bool) -> str:
    words = max(int(n_tokens / tokens_per_word), 1)
    body = " ".join(rng.choice(WORDS) for _ in range(words)).capitalize()
    return body + ("?" if question else ".")


def build_plan(w: Workload, encode: TextEncoder) -> Plan:
    """The system prompt (~``system_tokens``) and each user's message of each round
    (``message_tokens_min..max`` tokens): made-up docstring English, sized with
    ``encode`` (text -> ids)."""
    rng = random.Random(w.seed)
    sample = " ".join(WORDS)
    tpw = max(len(encode(sample)), 1) / len(WORDS)
    system = _text(rng, w.system_tokens, tpw, False)
    messages = tuple(
        tuple(_text(rng, rng.randint(w.message_tokens_min, w.message_tokens_max), tpw, True) for _ in range(w.rounds))
        for _ in range(w.users)
    )
    return Plan(system, messages)


# -- the arithmetic (pure) -------------------------------------------------


def shared_round1(prompts: Sequence[Sequence[int]]) -> list[int]:
    """Per round-1 prompt (in sending order): the longest prefix it shares with an earlier one."""
    return [max((lcp(p, q) for q in prompts[:i]), default=0) for i, p in enumerate(prompts)]


def _pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def per_request(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add the arithmetic to each record (in sending order; ``user``, ``round``,
    ``prompt_tokens``, ``cached_tokens``, ``completion_tokens``, and for round 1
    ``shared_tokens``; ``answer_kept_tokens`` where known): ``recomputed_tokens``,
    ``ideal_tokens``, ``answer_tokens`` (the previous answer's length),
    ``answer_hit_tokens`` (from usage: cached tokens past the previous prompt, at
    most the answer; None in round 1), ``previous_answer_kept`` (the ids of the
    previous answer the router keeps: all but those of a character cut at its end)."""
    prev: dict[Any, dict[str, Any]] = {}
    out = []
    for r in records:
        p = prev.get(r["user"])
        x = dict(r)
        x["recomputed_tokens"] = r["prompt_tokens"] - r["cached_tokens"]
        if p is None:
            x["ideal_tokens"] = r["prompt_tokens"] - r.get("shared_tokens", 0)
            x["answer_tokens"] = 0
            x["answer_hit_tokens"] = None
            x["previous_answer_kept"] = 0
        else:
            # an answer cut inside a character: the next prompt holds the text before the cut
            kept = p.get("answer_kept_tokens", p["completion_tokens"])
            x["ideal_tokens"] = r["prompt_tokens"] - (p["prompt_tokens"] + kept)
            x["previous_answer_kept"] = kept
            x["answer_tokens"] = p["completion_tokens"]
            x["answer_hit_tokens"] = min(max(r["cached_tokens"] - p["prompt_tokens"], 0), p["completion_tokens"])
        prev[r["user"]] = r
        out.append(x)
    return out


def _sum(rs: Sequence[dict[str, Any]], key: str) -> int | None:
    """Sum of ``key`` (None where any record lacks it)."""
    total = 0
    for r in rs:
        v = r.get(key)
        if v is None:
            return None
        total += int(v)
    return total if rs else None


def handoff_geometry(records: Sequence[dict[str, Any]]) -> tuple[float, float] | None:
    """``(KV bytes per token, fixed bytes)`` of the native handoff, from two requests
    with different prompts: a whole handoff is ``N x kv + fixed`` (the prompt's
    KV, the final state and the draft hidden). None without two such requests."""
    seen: dict[int, int] = {}
    for r in records:
        full = r.get("handoff_full_bytes")
        if full:
            seen.setdefault(int(r["prompt_tokens"]), int(full))
    if len(seen) < 2:
        return None
    (n1, f1), (n2, f2) = sorted(seen.items())[0], sorted(seen.items())[-1]
    kv = (f2 - f1) / (n2 - n1)
    return kv, f1 - n1 * kv


def handoff_bound(r: dict[str, Any], prev_prompt: int, unit: int, geometry: tuple[float, float]) -> float:
    """Issue #28's bound on a rounds->=2 handoff: ``(new tokens + u) x KV bytes per
    token + one state (+ draft hidden)``; new tokens are those past the previous prompt."""
    kv, fixed = geometry
    return (r["prompt_tokens"] - prev_prompt + unit) * kv + fixed


def _group(rs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per-request means, the answer hit ratios and TTFT over ``rs`` (records of ``per_request``)."""
    n = len(rs)
    ttft = [r["ttft_ms"] for r in rs]
    answer = sum(r["answer_tokens"] for r in rs)
    hit = sum(r["answer_hit_tokens"] or 0 for r in rs)
    m_hit, m_rec = _sum(rs, "metric_answer_hit"), _sum(rs, "metric_answer_recomputed")
    same, differs = _sum(rs, "metric_retokenized_same"), _sum(rs, "metric_retokenized_differs")
    client = [r["retokenized_differs"] for r in rs if r.get("retokenized_differs") is not None]
    nonspecial = [
        r["retokenized_differs_nonspecial"] for r in rs if r.get("retokenized_differs_nonspecial") is not None
    ]
    excess = [r["recomputed_tokens"] - r["ideal_tokens"] for r in rs]
    suffix = _sum(rs, "suffix_tokens")
    read, full = _sum(rs, "handoff_bytes"), _sum(rs, "handoff_full_bytes")
    bound = _sum(rs, "handoff_bound_bytes")
    return {
        # bytes each handoff read over NIXL (delta handoffs: only what decode lacked), beside
        # what it would have read whole (the full prompt's KV: every handoff before #28) and
        # the bound for rounds >= 2 ((new tokens + u) x KV bytes per token + state + draft)
        "handoff_bytes_per_request": None if read is None else read / n,
        "handoff_full_bytes_per_request": None if full is None else full / n,
        "handoff_bound_bytes_per_request": None if bound is None else bound / n,
        "num_requests": n,
        "prompt_tokens_per_request": sum(r["prompt_tokens"] for r in rs) / n,
        "cached_tokens_per_request": sum(r["cached_tokens"] for r in rs) / n,
        "recomputed_tokens_per_request": sum(r["recomputed_tokens"] for r in rs) / n,
        "ideal_tokens_per_request": sum(r["ideal_tokens"] for r in rs) / n,
        # the new message + template tokens tokenized alone (native tokenizer): equal to the
        # ideal where the prompt holds the generated ids; the ideal minus this is how much
        # longer the re-tokenized answer text is than the generated ids
        "suffix_tokens_per_request": None if suffix is None else suffix / n,
        "recomputed_minus_ideal_max": max(excess),
        "recomputed_minus_ideal_min": min(excess),
        "answer_tokens_per_request": answer / n,
        "answer_hit_tokens": hit,
        # tokens of the previous answer restored from cache (usage arithmetic; every variant)
        "answer_tokens_hit_ratio": _ratio(hit, answer),
        # the router's own count (hybridpd_answer_tokens_total deltas): only answers whose ids it recalled
        "answer_tokens_hit_ratio_metric": None if m_hit is None or m_rec is None else _ratio(m_hit, m_hit + m_rec),
        "answer_tokens_metric": None if m_hit is None or m_rec is None else {"hit": m_hit, "recomputed": m_rec},
        # answers the router recognized (recalled ids) and whose text re-tokenized to other ids
        "answers_recalled": None if same is None or differs is None else same + differs,
        "retokenized_differs_ratio": None if same is None or differs is None else _ratio(differs, same + differs),
        # the client's own check of the same on every answer: encode(text) != generated ids
        "retokenized_differs_ratio_client": _ratio(sum(client), len(client)) if client else None,
        # the same with the generated special ids (no text: <eos> under ignore_eos) left out
        "retokenized_differs_ratio_nonspecial": _ratio(sum(nonspecial), len(nonspecial)) if nonspecial else None,
        "ttft_p50_ms": statistics.median(ttft),
        "ttft_p90_ms": _pct(ttft, 0.9),
    }


def summarize(records: Sequence[dict[str, Any]], unit: int = 16) -> dict[str, Any]:
    """Overall (rounds >= 2) figures, plus ``per_round`` (every round, round 1
    included) and ``requests`` (each record with its arithmetic; on our native
    stack each rounds->=2 record gets its ``handoff_bound_bytes``, ``unit`` u)."""
    rs = per_request(records)
    geometry = handoff_geometry(rs)
    if geometry is not None:
        prev: dict[Any, int] = {}
        for r in rs:
            p = prev.get(r["user"])
            if p is not None and r.get("handoff_bytes") is not None:
                r["handoff_bound_bytes"] = handoff_bound(r, p, unit, geometry)
            prev[r["user"]] = r["prompt_tokens"]
    later = [r for r in rs if r["round"] >= 2]
    rounds = sorted({r["round"] for r in rs})
    out = _group(later) if later else {}
    out["counting"] = "rounds >= 2 (round 1 is per_round[0])"
    out["per_round"] = [{"round": k, **_group([r for r in rs if r["round"] == k])} for k in rounds]
    out["requests"] = rs
    return out
