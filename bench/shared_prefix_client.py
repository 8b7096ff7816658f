"""Sends the shared-prefix plan (``bench.shared_prefix``) to a server and records
each request: the client side of ``hybridpd bench shared-prefix``
(``bench.shared_prefix_run`` starts the servers).

Contract: requests go one at a time, streaming (TTFT: the first chunk with a
choice); ``usage.prompt_tokens_details.cached_tokens`` is the hit. Before the
plan, warm-up requests (``WARMUP``, then ``warmup_requests`` per prefill
engine) take the first-use costs out of the measured TTFTs; their TTFTs are
reported, not hidden. On our stack, state bytes come from the prefill actors'
counters in ``/v1/hybridpd/stats``, read (settled) after each phase.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import httpx

from bench.shared_prefix import ChatEncoder, PlannedRequest, Workload, ideal_tokens, summarize
from bench.stack_stats import load_spread, prefill_cache, prefill_computed


def native_chat_encoder() -> ChatEncoder:
    """The router's tokenization of chat messages (the bundled model's assets)."""
    from hybridpd.model_files import TOKENIZER_DIR
    from hybridpd.tokenizer import ChatMessage, TextTokenizer

    tok = TextTokenizer(TOKENIZER_DIR)
    return lambda msgs: tok.apply_chat_template([ChatMessage(r, c) for r, c in msgs])


def _send(
    client: httpx.Client, url: str, r: PlannedRequest, max_tokens: int, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        **(extra or {}),
        "model": "tiny",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if r.chat:
        body["messages"] = [{"role": role, "content": c} for role, c in r.messages]
    else:
        body["prompt"] = list(r.tokens)
    t0 = time.perf_counter()
    ttft = usage = None
    path = "/v1/chat/completions" if r.chat else "/v1/completions"
    with client.stream("POST", url + path, json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError("%s %s: %s" % (path, r.label, data["error"]))
            if ttft is None and data.get("choices"):
                ttft = time.perf_counter() - t0
            usage = data.get("usage") or usage
    assert usage is not None and ttft is not None, "stream without usage or tokens"
    return {"usage": usage, "ttft_ms": ttft * 1e3}


def _state_counter(url: str) -> tuple[str | None, int]:
    """The prefill actors' state bytes written to the store, summed: the
    ``checkpoint_state_bytes`` counter, else ``checkpoint_export_bytes`` (KV included)."""
    try:
        stats = httpx.get(url + "/v1/hybridpd/stats", timeout=30).json()
    except (httpx.HTTPError, ValueError):
        return None, 0
    prefill = [s for name, s in stats.items() if name.startswith("prefill")]
    for key in ("checkpoint_state_bytes", "checkpoint_export_bytes"):
        if prefill and all(key in s for s in prefill):
            return key, sum(int(s[key]) for s in prefill)
    return None, 0


def _settled_counter(url: str) -> tuple[str | None, int]:
    """The counter once exports in flight have landed (unchanged for 0.5 s; at most 10 s)."""
    key, last = _state_counter(url)
    deadline = time.monotonic() + 10
    while key is not None and time.monotonic() < deadline:
        time.sleep(0.5)
        now = _state_counter(url)[1]
        if now == last:
            break
        last = now
    return key, last


#: sent before the plan, not recorded: a token-id prompt (ids the plan's random
#: prompts share at most by chance, never a unit) and a chat prompt with no system message
WARMUP = (
    PlannedRequest("warmup", "ids", tokens=tuple(range(2047, 2047 - 40, -1))),
    PlannedRequest("warmup", "chat", messages=(("user", "Return the warm-up value."),)),
)
#: then, to every prefill engine, token-id prompts of the plan's sizes (random ids: they
#: share no unit with the plan or with another engine's), so that the first measured
#: requests pay no first-use costs (first kernels at a size, first NIXL transfer from
#: each prefill instance). By hand on stack-vllm after WARMUP alone: the first
#: 180-token prompts to each of its two prefill instances took 103-152 ms, later ones
#: 62-88 ms; an engine that gets more of the plan warms sooner, so without this a
#: stack with more engines paid more first-use costs inside the measured phases
WARMUP_LENGTHS = (96, 192, 320, 560)


def warmup_requests(engine: int) -> list[PlannedRequest]:
    """The sized warm-up prompts for the ``engine``-th prefill engine (its own ids)."""
    import random

    rng = random.Random(7919 + engine)
    return [
        PlannedRequest("warmup", "ids", tokens=tuple(rng.randrange(16, 2000) for _ in range(n))) for n in WARMUP_LENGTHS
    ]


def prefill_instances(args: Sequence[str]) -> tuple[str | None, ...]:
    """The prefill instances a stack started with ``args`` runs (``--num-prefill``, else
    the config's default), by the names a request pins (``hybridpd_prefill_instance``)."""
    from hybridpd.config import HybridPDConfig

    n = int(args[list(args).index("--num-prefill") + 1]) if "--num-prefill" in args else None
    count = n if n is not None else int(HybridPDConfig.model_fields["num_prefill"].default)
    return tuple("prefill-%d" % i for i in range(count))


def warm_up(client: httpx.Client, url: str, w: Workload, instances: Sequence[str | None]) -> list[float]:
    """Send ``WARMUP``, then ``warmup_requests`` to each of ``instances`` (pinned; None:
    a server with one prefill engine, unpinned). Returns their TTFTs (ms), for the JSON:
    first-use costs are reported, not hidden."""
    got = [_send(client, url, warm, w.max_tokens)["ttft_ms"] for warm in WARMUP]
    for i, instance in enumerate(instances):
        pin = {"hybridpd_prefill_instance": instance} if instance is not None else {}
        got += [_send(client, url, warm, w.max_tokens, pin)["ttft_ms"] for warm in warmup_requests(i)]
    return [round(t, 2) for t in got]


def run_plan(
    url: str | Sequence[str],
    plan: Sequence[PlannedRequest],
    w: Workload,
    encode: ChatEncoder,
    native: bool,
    instances: Sequence[str | None] = (None,),
) -> dict[str, Any]:
    """Warm up (``warm_up`` with ``instances``: a stack's prefill instances, None for a
    server with one prefill engine), then send ``plan`` to ``url`` one request at a time (several routers of one stack:
    request i to router ``i % n``, so consecutive requests never share one); ``encode`` gives the chat
    prompts' token ids (checked against ``usage.prompt_tokens``). ``native`` (our
    stack): read the state-bytes counter from ``/v1/hybridpd/stats`` after each
    phase, and record per request the tail checkpoint its prefill could leave
    (``checkpoints.planned_checkpoint`` of ``[cached, N)``; None: the protocol's
    rules forbid it, so a later request cannot hit the prompt's end)."""
    from tqdm import tqdm

    from hybridpd.checkpoints import planned_checkpoint
    from hybridpd.config import HybridPDConfig

    align = HybridPDConfig.model_fields["checkpoint_alignment"].default

    urls = [url] if isinstance(url, str) else list(url)
    url = urls[0]
    prompts = [encode(r.messages) if r.chat else list(r.tokens) for r in plan]
    ideals = ideal_tokens(prompts, w.unit)
    records: list[dict[str, Any]] = []
    state_bytes: dict[str, int] = {}
    with httpx.Client() as client:
        warmup = warm_up(client, url, w, instances)  # first-use costs out of the measured TTFTs
        counter, before = _settled_counter(url) if native else (None, 0)
        computed = prefill_computed(client, url)
        for i, r in enumerate(tqdm(plan, desc="requests", unit="req")):
            res = _send(client, urls[i % len(urls)], r, w.max_tokens)
            u = res["usage"]
            records.append(
                {
                    "phase": r.phase,
                    "label": r.label,
                    "counted": r.counted,
                    "prompt_tokens": len(prompts[i]),
                    "reported_prompt_tokens": u["prompt_tokens"],
                    "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                    "ideal_tokens": ideals[i],
                    "ttft_ms": res["ttft_ms"],
                    "prefix_tokens": u.get("hybridpd_prefix_tokens"),
                }
            )
            if native:
                n, hit = len(prompts[i]), records[-1]["cached_tokens"]
                records[-1]["tail_checkpoint"] = planned_checkpoint(hit, n, n, w.unit, w.mamba_block_size, align, False)
            if counter is not None and (i + 1 == len(plan) or plan[i + 1].phase != r.phase):
                after = _settled_counter(url)[1]
                state_bytes[r.phase], before = after - before, after
        load = load_spread(computed, prefill_computed(client, url))
        held = prefill_cache(client, url)
    cached, ideal = sum(x["cached_tokens"] for x in records), sum(x["ideal_tokens"] for x in records)
    return {
        "phases": summarize(records, state_bytes if counter else None),
        "hit_ratio_all_phases": cached / ideal if ideal else float("nan"),
        "routers": len(urls),
        "prefill_load": load,
        "prefill_cache": held,
        "state_bytes_counter": counter,
        "prompt_tokens_match": all(x["prompt_tokens"] == x["reported_prompt_tokens"] for x in records),
        "warmup_ttft_ms": warmup,
        "requests": records,
    }
