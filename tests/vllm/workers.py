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
    """Prefill requests ``(rid, tokens, max_tokens[, corrupt])``; with ``corrupt``
    one block of the handoff is negated before it is offered
    (:func:`corrupt_handoff_block`): the fault the comparison must catch."""
    import queue

    eng = _engine("prefill", overrides, side_port)
    q_out.put("ready")
    while True:
        try:  # between requests, keep stepping while the connector holds KV for decode (as the actors do)
            msg = q_in.get(timeout=0.01) if eng.has_work() else q_in.get()
        except queue.Empty:
            eng.step()
            continue
        if msg == "exit":
            break
        rid, toks, max_tokens, *rest = msg
        request = req(rid, toks, max_tokens)
        eng.add_request(request, prefill_only=True)
        outs = []
        while not any(o.finished for o in outs) and eng.has_work():
            outs.extend(o for o in eng.step() if o.request_id == rid)
        ticket = eng.pop_handoff(rid)
        if rest and rest[0]:
            corrupt_handoff_block(eng, ticket.kv_transfer_params)
        q_out.put((request, ticket, [t for o in outs for t in o.new_token_ids]))
    q_out.put("bye")


def corrupt_handoff_block(eng, params: dict[str, Any]) -> str:  # type: ignore[no-untyped-def]
    """Overwrite one block of the handoff in ``eng``'s cache with garbage (seeded
    normal noise, as a transfer of the wrong memory would deliver), in place,
    before decode READs it: the first attention KV block of the first full
    attention layer. Returns the layer touched."""
    import torch
    from vllm.model_executor.layers.attention.attention import Attention

    block_ids = params["remote_block_ids"]  # one list per KV cache group
    groups = eng.engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
    ctx = eng.engine.vllm_config.compilation_config.static_forward_context
    gen = torch.Generator().manual_seed(0)
    for name, layer in ctx.items():
        if not isinstance(layer, Attention):
            continue
        group = next(i for i, g in enumerate(groups) if name in g.layer_names)
        block = layer.kv_cache[block_ids[group][0]]  # [num_blocks, ...]: this block's K and V
        with torch.inference_mode():
            block.copy_(torch.randn(block.shape, generator=gen).to(block.dtype))
        return name
    raise AssertionError("no attention layer found")


def decode_worker(q_in, q_out, side_port: int, overrides: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    eng = _engine("decode", overrides, side_port)
    q_out.put("ready")
    while (msg := q_in.get()) != "exit":
        request, ticket = msg
        eng.add_handoff(request, eng.fetch_handoff(request, ticket))
        got: list[int] = []
        while eng.has_work():
            for o in eng.step():
                got.extend(o.new_token_ids)
        q_out.put(got)
    q_out.put("bye")


def events_worker(q_out, redis_url: str, prompts: list[tuple[str, list[int], str | None]], max_tokens: int) -> None:  # type: ignore[no-untyped-def]
    """A vLLM engine with cache events, mirrored into the index as instance
    'vllm-0' the way the prefill worker does (``PrefixIndex.apply_local``);
    reports each request's cached tokens and the feed's counters."""
    import time

    from hybridpd.engine.base import Engine
    from hybridpd.index.prefix_index import PrefixIndex

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from hybridpd.engine.vllm.engine import VllmEngine
    from hybridpd.engine.vllm.tiny import resolve

    eng = VllmEngine(load_config(env={}, overrides=BASE), resolve(), "local", cache_events=True)
    assert isinstance(eng, Engine)  # the engine boundary holds at run time for vLLM too
    feed = eng.feed
    assert feed is not None
    index = PrefixIndex(redis_url, eng.model_id)
    # NOTE: a fixed wait, not a poll: ZMQ PUB/SUB drops what is published before the
    # subscription reaches the publisher, and nothing tells the subscriber that it has
    time.sleep(0.5)  # the subscriber joins before the first event
    out: dict[str, Any] = {"model_id": eng.model_id}
    for rid, toks, salt in prompts:
        eng.add_request(req(rid, toks, max_tokens, salt))
        cached = 0
        while eng.has_work():
            for o in eng.step():
                cached = max(cached, o.num_cached_tokens)
        out[rid] = cached
        # NOTE: a fixed wait, not a poll: vLLM publishes a batch only for a step with events,
        # so "every batch arrived" is not observable from here without vLLM's internals
        time.sleep(0.5)  # events are published after the step that stored the blocks
        index.apply_local("vllm-0", eng.pop_cache_events())
    out["feed"] = {
        "published_kv": feed.published_kv,
        "published_states": feed.published_states,
        "mismatches": feed.mismatches,
    }
    eng.close()
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


def reference_worker(
    q_out, prompts, max_tokens: int, candidates: dict[str, list[int]], overrides: dict[str, Any]
) -> None:  # type: ignore[no-untyped-def]
    """The reference of the tolerance-aware comparison (``tests/greedy.py``): a
    local engine with the tests' settings, prefix caching off, runs each prompt
    greedily with its top-2 logprobs (-> margins), then ``prompt + candidate``
    with prompt logprobs (teacher forcing -> each candidate token's deficit)."""
    from vllm.sampling_params import SamplingParams

    eng = _engine("local", {**overrides, "enable_prefix_caching": False})
    core = eng.engine

    def run(rid: str, toks: list[int], sp: Any) -> Any:
        core.add_request(rid, {"prompt_token_ids": list(toks)}, sp)
        final = None
        while core.has_unfinished_requests():
            for o in core.step():
                if o.finished:
                    final = o
        return final

    def ranked(entry: Any) -> list[float]:
        return sorted((lp.logprob for lp in entry.values()), reverse=True)

    out: dict[str, Any] = {}
    for rid, toks in prompts:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=2, ignore_eos=True, detokenize=False)
        comp = run(rid, toks, sp).outputs[0]
        margins = []
        for entry in comp.logprobs:
            top = ranked(entry)
            margins.append(top[0] - top[1] if len(top) > 1 else float("inf"))
        deficits = None
        cand = candidates.get(rid)
        if cand is not None:
            sp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1, detokenize=False)
            pl = run(rid + "-forced", list(toks) + list(cand), sp).prompt_logprobs
            deficits = []
            for j, t in enumerate(cand):
                entry = pl[len(toks) + j]
                deficits.append(ranked(entry)[0] - entry[t].logprob)
        out[rid] = {"tokens": list(comp.token_ids), "margins": margins, "deficits": deficits}
    q_out.put(out)


def run_reference(
    prompts: list[tuple[str, list[int]]], max_tokens: int, candidates: dict[str, list[int]], **overrides: Any
) -> dict[str, Any]:
    """``reference_worker`` in a fresh spawned process: per prompt, a
    ``GreedyReference`` and the candidate's teacher-forced deficits."""
    import multiprocessing as mp

    from tests.greedy import GreedyReference

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=reference_worker, args=(q, prompts, max_tokens, candidates, overrides))
    p.start()
    try:
        raw = q.get(timeout=600)
    finally:
        p.join(60)
    return {rid: (GreedyReference(r["tokens"], r["margins"]), r["deficits"]) for rid, r in raw.items()}


def assert_match_reference(prompts: list[tuple[str, list[int]]], max_tokens: int, got: dict[str, list[int]]) -> None:
    """Every ``got[rid]`` is a greedy output of a local no-cache run of its
    prompt up to bf16 rounding (``tests/greedy.py``'s rule, teacher-forced)."""
    from tests.greedy import BF16_TOL, assert_greedy_matches

    refs = run_reference(prompts, max_tokens, got)
    for rid, _ in prompts:
        ref, deficits = refs[rid]
        assert_greedy_matches(got[rid], ref, BF16_TOL, deficits, what=rid)
