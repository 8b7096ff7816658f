"""Engine processes for the vLLM tests (spawned: one vLLM engine per process,
as in the actors; each gets its own NIXL side-channel port)."""

from __future__ import annotations

import os
from typing import Any

from hybridpd.config import load_config
from hybridpd.engine.base import EngineRequest, RequestId, SamplingParams

#: HYBRIDPD_TEST_DEVICE=cuda runs the same tests on a GPU (scripts/gpu_check.sh)
BASE = {
    "engine": "vllm",
    "dtype": "bfloat16",
    "device": os.environ.get("HYBRIDPD_TEST_DEVICE", "cpu"),
    "max_model_len": 8192,
    "max_num_batched_tokens": 8192,
}


def _engine(role: str, overrides: dict[str, Any], side_port: int | None = None):  # type: ignore[no-untyped-def]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if side_port is not None:
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_port)
        os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
    from hybridpd.engine.vllm.engine import VllmEngine
    from hybridpd.engine.vllm.tiny import resolve

    return VllmEngine(load_config(env={}, overrides={**BASE, **overrides}), resolve(), role)  # type: ignore[arg-type]


def req(rid: str, tokens: list[int], max_tokens: int, salt: str | None = None) -> EngineRequest:
    return EngineRequest(RequestId(rid), tuple(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True), salt)


def local_worker(q_out, prompts: list[tuple[str, list[int]]], max_tokens: int, overrides: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    """Run prompts one after another; report tokens and cached tokens per prompt."""
    eng = _engine("local", overrides)
    out = {}
    for rid, toks in prompts:
        eng.add_request(req(rid, toks, max_tokens))
        got: list[int] = []
        cached = 0
        while eng.has_work():
            for o in eng.step():
                got.extend(o.new_token_ids)
                cached = max(cached, o.num_cached_tokens)
        out[rid] = {"tokens": got, "cached": cached}
    out["_stats"] = eng.stats()
    q_out.put(out)


def prefill_worker(q_in, q_out, side_port: int, overrides: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    eng = _engine("prefill", overrides, side_port)
    q_out.put("ready")
    while (msg := q_in.get()) != "exit":
        rid, toks, max_tokens = msg
        eng.add_request(req(rid, toks, max_tokens), prefill_only=True)
        first: list[int] = []
        while eng.has_work():
            for o in eng.step():
                first.extend(o.new_token_ids)
        q_out.put(eng.handoffs.pop(rid))
    q_out.put("bye")


def decode_worker(q_in, q_out, side_port: int, overrides: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    eng = _engine("decode", overrides, side_port)
    q_out.put("ready")
    while (msg := q_in.get()) != "exit":
        eng.add_handoff(msg)
        got: list[int] = []
        while eng.has_work():
            for o in eng.step():
                got.extend(o.new_token_ids)
        q_out.put(got)
    q_out.put("bye")


def events_worker(q_out, redis_url: str, prompts: list[tuple[str, list[int], str | None]], max_tokens: int) -> None:  # type: ignore[no-untyped-def]
    """A vLLM engine publishing KV events, mirrored into the index as instance
    'vllm-0'; reports each request's cached tokens and the feed's counters."""
    import time

    from hybridpd.engine.vllm.kv_events import KVEventFeed, kv_events_endpoint
    from hybridpd.index.prefix_index import PrefixIndex

    endpoint = kv_events_endpoint()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from hybridpd.engine.vllm.engine import VllmEngine
    from hybridpd.engine.vllm.tiny import resolve

    eng = VllmEngine(load_config(env={}, overrides=BASE), resolve(), "local", kv_events_endpoint=endpoint)
    feed = KVEventFeed(PrefixIndex(redis_url, eng.model_id), "vllm-0", eng.hasher)
    feed.start(endpoint)
    time.sleep(0.5)  # the subscriber joins before the first event
    out: dict[str, Any] = {"model_id": eng.model_id}
    for rid, toks, salt in prompts:
        eng.add_request(req(rid, toks, max_tokens, salt))
        cached = 0
        while eng.has_work():
            for o in eng.step():
                cached = max(cached, o.num_cached_tokens)
        out[rid] = cached
        feed.index.publish_local("vllm-0", eng.cached_hashes(list(toks), salt)[0], ())  # as the prefill actor does
        time.sleep(0.5)  # events are published after the step that stored the blocks
    out["feed"] = {
        "published_kv": feed.published_kv,
        "published_states": feed.published_states,
        "mismatches": feed.mismatches,
    }
    feed.close()
    q_out.put(out)


def tokens(n: int, seed: int) -> list[int]:
    """``n`` random token ids (outside the special ids), reproducible from ``seed``."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(5, 2048) for _ in range(n)]


def run_local(prompts: list[tuple[str, list[int]]], max_tokens: int, **overrides: Any) -> dict:
    """``local_worker`` in a fresh spawned process (one vLLM engine per process)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=local_worker, args=(q, prompts, max_tokens, overrides))
    p.start()
    try:
        return q.get(timeout=600)
    finally:
        p.join(60)
