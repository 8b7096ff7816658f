"""Engine processes for the vLLM tests (spawned: one vLLM engine per process,
as in the actors; each gets its own NIXL side-channel port)."""

from __future__ import annotations

import os
import time
from dataclasses import replace
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


def _engine(role: str, overrides: dict[str, Any], side_port: int | None = None, **kw: Any):  # type: ignore[no-untyped-def]
    """A VllmEngine in ``role`` with the tests' settings; ``kw`` go to VllmEngine."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if side_port is not None:
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_port)
        os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
    from hybridpd.engine.vllm.engine import VllmEngine
    from hybridpd.engine.vllm.tiny import resolve

    return VllmEngine(load_config(env={}, overrides={**BASE, **overrides}), resolve(), role, **kw)  # type: ignore[arg-type]


def next_message(eng, q_in) -> Any:  # type: ignore[no-untyped-def]
    """The next message on ``q_in``; while none has come, ``eng`` keeps stepping as
    long as it has work (a connector holds KV for decode until its read is
    acknowledged, and only a step processes that: as the actors do)."""
    import queue

    while True:
        try:
            return q_in.get(timeout=0.01) if eng.has_work() else q_in.get()
        except queue.Empty:
            eng.step()


def req(rid: str, tokens: list[int], max_tokens: int, salt: str | None = None) -> EngineRequest:
    return EngineRequest(RequestId(rid), tuple(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True), salt)


def local_worker(q_out, prompts: list[tuple[str, list[int]]], max_tokens: int, overrides: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    """Run prompts ``(rid, tokens[, checkpoints])`` one after another; report
    tokens, cached tokens and the checkpoint positions the engine reported writing
    per prompt (and ``_prefixes``: checkpoint prefixes run, ``_released``: those
    released before their sampled token)."""
    eng = _engine("local", overrides)
    out = {}
    for rid, toks, *positions in prompts:
        eng.add_request(replace(req(rid, toks, max_tokens), checkpoints=tuple(positions[0]) if positions else ()))
        got: list[int] = []
        cached = 0
        written: list[tuple[int, ...]] = []
        while eng.has_work():
            for o in eng.step():
                got.extend(o.new_token_ids)
                cached = max(cached, o.num_cached_tokens)
                written.append(o.checkpoints.positions)
        out[rid] = {"tokens": got, "cached": cached, "checkpoints": written[0], "later": set(written[1:])}
    out["_stats"] = eng.stats()
    out["_prefixes"] = eng.stages.prefixes_run
    out["_released"] = eng.stages.prefixes_released
    q_out.put(out)


def prefill_worker(q_in, q_out, side_port: int, overrides: dict[str, Any], send_hold_s: float | None = None) -> None:  # type: ignore[no-untyped-def]
    """Prefill requests ``(rid, tokens, max_tokens[, corrupt])``; with ``corrupt``
    one block of the handoff is negated before it is offered
    (:func:`corrupt_handoff_block`): the fault the comparison must catch.
    ``send_hold_s``: the engine's ``SEND_HOLD_S`` in this process."""
    if send_hold_s is not None:
        from hybridpd.engine.vllm import sequencer as vllm_sequencer

        vllm_sequencer.SEND_HOLD_S = send_hold_s
    eng = _engine("prefill", overrides, side_port)
    q_out.put("ready")
    while True:
        msg = next_message(eng, q_in)
        if msg == "exit":
            break
        if msg == "settle":  # step until the engine is idle: background work (a tail stage) done
            deadline = time.monotonic() + 300
            while eng.has_work() and time.monotonic() < deadline:
                eng.step()
            q_out.put(("settled", eng.has_work(), eng.ledger.background_runs))
            continue
        if msg == "tries":  # background requests handed to vLLM's queues so far, and those not yet done
            q_out.put(("tries", eng.ledger.background_runs, len(eng.background)))
            continue
        rid, toks, max_tokens, *rest = msg  # rest: [corrupt[, checkpoints]]
        request = req(rid, toks, max_tokens)
        if len(rest) > 1:
            request = replace(request, checkpoints=tuple(rest[1]))
        eng.add_request(request, prefill_only=True)
        outs = []
        while not any(o.finished for o in outs) and eng.has_work():
            outs.extend(o for o in eng.step() if o.request_id == rid)
        ticket = eng.pop_handoff(rid)
        if rest and rest[0]:
            corrupt_handoff_block(eng, ticket.kv_transfer_params)
        written = [o.checkpoints.positions for o in outs]
        q_out.put((request, ticket, [t for o in outs for t in o.new_token_ids], written))
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


class PdPair:
    """A prefill and a decode engine, each in its own spawned process
    (:func:`prefill_worker`, :func:`decode_worker`), as a context manager."""

    def __init__(self, overrides: dict[str, Any] | None = None, send_hold_s: float | None = None) -> None:
        import multiprocessing as mp

        from hybridpd.procs import free_port

        ctx = mp.get_context("spawn")
        self.qp_in, self.qp_out, self.qd_in, self.qd_out = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
        self.pre = ctx.Process(
            target=prefill_worker, args=(self.qp_in, self.qp_out, free_port(), overrides or {}, send_hold_s)
        )
        self.dec = ctx.Process(target=decode_worker, args=(self.qd_in, self.qd_out, free_port(), overrides or {}))
        #: per request, the checkpoint positions each of its prefill outputs reported (the first: all)
        self.written: dict[str, list[tuple[int, ...]]] = {}

    def __enter__(self) -> PdPair:
        self.pre.start()
        self.dec.start()
        assert self.qp_out.get(timeout=300) == "ready" and self.qd_out.get(timeout=300) == "ready"
        return self

    def run(
        self, rid: str, toks: list[int], max_tokens: int, corrupt: bool = False, checkpoints: tuple[int, ...] = ()
    ) -> tuple[Any, Any, list[int], list[int]]:
        """Prefill ``toks`` (``corrupt``: one handoff block negated first), decode it:
        (the request, the ticket, the prefill's tokens, decode's tokens)."""
        request, ticket, prefill_tokens = self.prefill(rid, toks, max_tokens, corrupt, checkpoints)
        return request, ticket, prefill_tokens, self.decode(request, ticket)

    def prefill(
        self, rid: str, toks: list[int], max_tokens: int, corrupt: bool = False, checkpoints: tuple[int, ...] = ()
    ) -> tuple[Any, Any, list[int]]:
        """Only the prefill half of :meth:`run`: (the request, the ticket, its tokens)."""
        self.qp_in.put((rid, toks, max_tokens, corrupt, checkpoints))
        request, ticket, prefill_tokens, self.written[rid] = self.qp_out.get(timeout=300)
        return request, ticket, prefill_tokens

    def decode(self, request: Any, ticket: Any) -> list[int]:
        """Decode a prefilled request from its ticket: decode's tokens."""
        self.qd_in.put((request, ticket))
        return list(self.qd_out.get(timeout=300))

    def tries(self) -> tuple[int, int]:
        """The prefill engine's background tries run so far, and those queued."""
        self.qp_in.put("tries")
        tag, tries, queued = self.qp_out.get(timeout=300)
        assert tag == "tries"
        return int(tries), int(queued)

    def settle(self) -> int:
        """Let the prefill engine run its background work; returns the background
        tries it has run so far."""
        self.qp_in.put("settle")
        tag, busy, tries = self.qp_out.get(timeout=400)
        assert tag == "settled" and not busy, "the prefill engine did not go idle"
        return int(tries)

    def __exit__(self, *exc: object) -> None:
        self.qp_in.put("exit")
        self.qd_in.put("exit")
        self.pre.join(60)
        self.dec.join(60)


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


def run_spawned(target: Any, *args: Any, timeout_s: float = 600) -> Any:
    """``target(queue, *args)`` in a fresh spawned process (one vLLM engine per
    process); returns the first thing it puts on the queue."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(q, *args))
    p.start()
    try:
        return q.get(timeout=timeout_s)
    finally:
        p.join(60)


def run_local(prompts: list[tuple[Any, ...]], max_tokens: int, **overrides: Any) -> dict:
    """``local_worker`` in a fresh spawned process (one vLLM engine per process)."""
    return run_spawned(local_worker, prompts, max_tokens, overrides)


def reference_worker(q_in, q_out, overrides: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    """The reference of the tolerance-aware comparison (``tests/greedy.py``): a
    local engine with the tests' settings, prefix caching off, kept for the session
    (:class:`Reference`). Per message ``(prompts, max_tokens, candidates)`` it runs
    each prompt greedily with its top-2 logprobs (-> margins), then ``prompt +
    candidate`` with prompt logprobs (teacher forcing -> each candidate token's
    deficit). Without a prefix cache, and one request at a time, an answer does not
    depend on what the engine ran before: a fresh engine's answer."""
    from vllm.sampling_params import SamplingParams

    eng = _engine("local", {**overrides, "enable_prefix_caching": False})
    core = eng.engine
    calls = 0

    def run(rid: str, toks: list[int], sp: Any) -> Any:
        core.add_request("ref%d-%s" % (calls, rid), {"prompt_token_ids": list(toks)}, sp)
        final = None
        while core.has_unfinished_requests():
            for o in core.step():
                if o.finished:
                    final = o
        return final

    def ranked(entry: Any) -> list[float]:
        return sorted((lp.logprob for lp in entry.values()), reverse=True)

    while (msg := q_in.get()) != "exit":
        prompts, max_tokens, candidates = msg
        calls += 1
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
    eng.close()


class Reference:
    """:func:`reference_worker` in a spawned process, started on first use and kept
    until :func:`close_references` (``tests/vllm/conftest.py``, at the session's end):
    one engine start for every comparison of the session, not one per comparison."""

    def __init__(self, overrides: dict[str, Any]) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.q_in, self.q_out = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=reference_worker, args=(self.q_in, self.q_out, overrides))
        self.proc.start()

    def ask(self, prompts: list[tuple[str, list[int]]], max_tokens: int, candidates: dict[str, list[int]]) -> Any:
        import queue

        self.q_in.put((prompts, max_tokens, candidates))
        deadline = time.monotonic() + 600
        while True:  # the answer, or the worker's death named (not a wait to the deadline)
            try:
                return self.q_out.get(timeout=2)
            except queue.Empty:
                assert self.proc.is_alive(), "the reference engine exited (%s)" % self.proc.exitcode
                assert time.monotonic() < deadline, "the reference engine did not answer in 600 s"

    def close(self) -> None:
        if self.proc.is_alive():
            self.q_in.put("exit")
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


#: the session's reference engines, by their overrides (:class:`Reference`)
_REFERENCES: dict[tuple[tuple[str, Any], ...], Reference] = {}


def close_references() -> None:
    """Stop the reference engines this session started."""
    while _REFERENCES:
        _REFERENCES.popitem()[1].close()


def run_reference(
    prompts: list[tuple[str, list[int]]], max_tokens: int, candidates: dict[str, list[int]], **overrides: Any
) -> dict[str, Any]:
    """The session's :class:`Reference` for ``overrides`` (started on first use):
    per prompt, a ``GreedyReference`` and the candidate's teacher-forced deficits."""
    from tests.greedy import GreedyReference

    key = tuple(sorted(overrides.items()))
    ref = _REFERENCES.get(key)
    if ref is None or not ref.proc.is_alive():
        ref = _REFERENCES[key] = Reference(overrides)
    raw = ref.ask(prompts, max_tokens, candidates)
    return {rid: (GreedyReference(r["tokens"], r["margins"]), r["deficits"]) for rid, r in raw.items()}


def assert_match_reference(prompts: list[tuple[str, list[int]]], max_tokens: int, got: dict[str, list[int]]) -> None:
    """Every ``got[rid]`` is a greedy output of a local no-cache run of its
    prompt up to bf16 rounding (``tests/greedy.py``'s rule, teacher-forced)."""
    from tests.greedy import BF16_TOL, assert_greedy_matches

    refs = run_reference(prompts, max_tokens, got)
    for rid, _ in prompts:
        ref, deficits = refs[rid]
        assert_greedy_matches(got[rid], ref, BF16_TOL, deficits, what=rid)


def forward_store_events() -> None:
    """Test-only: let the MooncakeStoreConnector's KV events out of a MultiConnector.

    vLLM 0.32's MultiConnector has no ``get_kv_connector_kv_cache_events`` (a TODO in
    multi_connector.py), so on a P/D prefill engine (MultiConnector: Nixl + Mooncake
    store) the store connector's ``BlockStored(medium="cpu")`` events never leave the
    worker and the index gets no store entries from vLLM at all. This returns the
    first sub-connector's events (only the store connector has any), so the truth
    test can check the store tier of ``KVEventFeed`` against the store."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    def get_kv_connector_kv_cache_events(self: Any) -> Any:
        for c in self._connectors:
            events = c.get_kv_connector_kv_cache_events()
            if events is not None:
                return events
        return None

    MultiConnector.get_kv_connector_kv_cache_events = get_kv_connector_kv_cache_events  # type: ignore[method-assign]


class TruthProbe:
    """What a vLLM engine in this process, and its MooncakeStoreConnector, can deliver
    for a prompt now, read without side effects (``test_index_truth``):

    * ``local_hit``: the engine's ``VllmEngine.local_hit`` (vLLM's admission lookup,
      ``KVCacheManager.get_computed_blocks``, on a fresh request: it reads the block
      pool's hash table only: no reference counts, no free-queue order, no events;
      capped at the request's tokens - 1);
    * ``attention_hit``: the full-attention group's own hit within ``length`` tokens
      (``HybridKVCacheCoordinator.find_longest_cache_hit_per_group``, read-only too);
    * ``store_hit``: the engine's ``VllmEngine.store_hit`` (the store connector's
      own lookup: ``batch_is_exist`` on the Mooncake keys of every group and the
      connector's hybrid hit rule over them);
    * ``attention_cached``: whether the full-attention group holds an entry (a full
      block, or a partial one) keyed by a hash (``BlockPool.get_cached_block``).

    ``answer`` asserts the probes left the block pool as they found it."""

    def __init__(self, eng: Any) -> None:
        self.eng = eng
        core = eng._core()
        self.sched = core.scheduler
        self.mgr = self.sched.kv_cache_manager
        self.pool = self.mgr.block_pool
        self.fa_group = self.mgr.coordinator.full_attention_group_id

    def local_hit(self, tokens: list[int], salt: str | None) -> int:
        return int(self.eng.local_hit(tokens, salt))

    def attention_hit(self, tokens: list[int], salt: str | None, length: int) -> int:
        req = self.eng._probe(self.eng._core(), tokens, salt)
        _, hits = self.mgr.coordinator.find_longest_cache_hit_per_group(req.block_hashes, length)
        return int(hits[self.fa_group])

    def store_hit(self, tokens: list[int], salt: str | None) -> int:
        return int(self.eng.store_hit(tokens, salt))

    def attention_cached(self, h: bytes) -> bool:
        return self.pool.get_cached_block(h, [self.fa_group]) is not None

    def snapshot(self) -> tuple[int, int, int]:
        return (self.pool.get_num_free_blocks(), len(self.pool.kv_event_queue), len(self.sched.requests))

    def answer(
        self,
        queries: list[tuple[str, list[int], str | None, int]],
        hashes: list[bytes] = (),  # type: ignore[assignment]
    ) -> tuple[list[int], list[bool]]:
        """``(op, tokens, salt, n)`` each: op "local" / "store" over ``tokens[:n]``,
        "attention" over ``tokens`` within ``n`` tokens; and per hash of ``hashes``
        whether the full-attention group holds an entry keyed by it."""
        before = self.snapshot()
        out = []
        for op, toks, salt, n in queries:
            if op == "local":
                out.append(self.local_hit(toks[:n], salt))
            elif op == "store":
                out.append(self.store_hit(toks[:n], salt))
            else:
                out.append(self.attention_hit(toks, salt, n))
        cached = [self.attention_cached(h) for h in hashes]
        assert self.snapshot() == before, (before, self.snapshot())  # the probes changed nothing
        return out, cached


def _store_worker() -> Any:
    """vLLM's MooncakeStoreConnector worker side in this process (the engine's)."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

    top = get_kv_transfer_group()
    return next(
        c.connector_worker
        for c in (top, *getattr(top, "sub_connectors", ()))
        if hasattr(getattr(c, "connector_worker", None), "store_replicate_config")
    )


def spy_store_puts() -> list[str]:
    """The keys vLLM's store put thread writes from now on, as a list it appends to."""
    thread = _store_worker().kv_send_thread
    real, keys = thread.store, []

    class Spy:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def batch_put_from_multi_buffers(self, batch: list[str], *args: Any) -> Any:
            keys.extend(batch)
            return real.batch_put_from_multi_buffers(batch, *args)

    thread.store = Spy()
    return keys


def replica_endpoints(keys: list[str]) -> list[str]:
    """The store segments (transport endpoints) that hold in-memory replicas of ``keys``."""
    store = _store_worker().store
    found = set()
    for key in keys:
        for replica in store.get_replica_desc(key):
            if replica.is_memory_replica():
                found.add(str(replica.get_memory_descriptor().buffer_descriptor.transport_endpoint))
    return sorted(found)


def truth_prefill_worker(  # type: ignore[no-untyped-def]
    q_in,
    q_out,
    side_port: int,
    redis_url: str,
    store: tuple[str, str],
    kv_blocks: int,
    instance: str,
    overrides,
    forward_store: bool = True,
) -> None:
    """A P/D prefill engine (cache events on, ``kv_blocks`` pages of KV and state,
    MooncakeStoreConnector on ``store``; ``forward_store``: its store events reach
    the feed, :func:`forward_store_events`) whose translated cache events go to the
    index as ``instance`` (``PrefixIndex.apply_local``, as ``CachePublisher`` does).
    Messages: ``("prefill", rid, tokens, salt)`` -> ``(request, ticket, cached,
    before)`` where ``before`` is what the engine and the store could deliver for
    the P/D prompt (its first N - 1 tokens) just before it ran; ``("settle",)``
    steps until the engine is idle (decode pulled, store saves done, every block
    free), waits until every event batch vLLM published went through the feed,
    publishes the translated events and answers the feed's counters;
    ``("probe", queries, hashes)`` -> ``TruthProbe.answer``; ``("placement",)`` -> the
    engine's own store segment, the keys its store puts wrote and the segments holding them."""
    import time

    from hybridpd.index.prefix_index import PrefixIndex

    if forward_store:
        forward_store_events()
    blocks = {**overrides, "vllm_kv_cache_blocks": kv_blocks}
    eng = _engine("prefill", blocks, side_port, cache_events=True, store=store)
    feed = eng.feed
    assert feed is not None
    probe = TruthProbe(eng)
    put_keys = spy_store_puts()
    index = PrefixIndex(redis_url, eng.model_id)
    index.clear_local(instance)
    # count vLLM's event batches and the feed's applied ones: "every batch arrived" is then observable
    published = [0]
    applied = [0]
    store_events = [0]
    publisher = probe.sched.kv_event_publisher
    publish, apply = publisher.publish, feed.apply

    def counted_publish(batch: Any) -> None:
        published[0] += 1
        publish(batch)

    def counted_apply(events: Any) -> None:
        events = list(events)
        store_events[0] += sum(1 for e in events if getattr(e, "medium", None) == "cpu")
        apply(events)
        applied[0] += 1

    # mismatches (events that do not match our chain: skipped) by medium; a store put names no
    # cache salt (no extra keys), so a salted prompt's first block cannot match: counted apart
    mismatches = {"local": 0, "store": 0, "store_first_block_unsalted": 0}
    stored = feed._stored

    def counted_stored(ev: Any) -> None:
        before = feed.mismatches
        stored(ev)
        if feed.mismatches > before:
            if getattr(ev, "medium", None) != "cpu":
                mismatches["local"] += feed.mismatches - before
            elif ev.parent_block_hash is None and not ev.extra_keys:
                mismatches["store_first_block_unsalted"] += feed.mismatches - before
            else:
                mismatches["store"] += feed.mismatches - before

    publisher.publish = counted_publish
    feed.apply = counted_apply  # type: ignore[method-assign]
    feed._stored = counted_stored  # type: ignore[method-assign]
    # NOTE: a fixed wait, not a poll: ZMQ PUB/SUB drops what is published before the
    # subscription reaches the publisher, and nothing tells the subscriber that it has
    time.sleep(0.5)
    groups = {g: (s.kind, s.block_size) for g, s in eng._groups().items()}
    q_out.put(("ready", eng.model_id, probe.pool.num_gpu_blocks, groups, getattr(eng, "prefill_backoff", 1)))
    while True:
        msg = next_message(eng, q_in)
        if msg == "exit":
            break
        if msg[0] == "prefill":
            _, rid, toks, salt = msg
            before, _ = probe.answer([("local", toks, salt, len(toks) - 1), ("store", toks, salt, len(toks) - 1)])
            request = req(rid, toks, 4, salt)
            eng.add_request(request, prefill_only=True)
            outs: list[Any] = []
            while not any(o.finished for o in outs) and eng.has_work():
                outs.extend(o for o in eng.step() if o.request_id == rid)
            cached = max((o.num_cached_tokens for o in outs), default=0)
            q_out.put((request, eng.pop_handoff(rid), cached, before))
        elif msg[0] == "settle":
            deadline = time.monotonic() + 300
            while eng.has_work():
                eng.step()
                assert time.monotonic() < deadline, "the prefill engine did not go idle"
            free = probe.pool.get_num_free_blocks()
            assert free == probe.pool.num_gpu_blocks - 1, ("blocks still held", free)  # vLLM keeps one null block
            while applied[0] < published[0]:
                assert time.monotonic() < deadline, ("event batches not applied", applied[0], published[0])
                time.sleep(0.01)
            events = eng.pop_cache_events()
            index.apply_local(instance, events)
            q_out.put(
                {
                    "published": published[0],
                    "applied": applied[0],
                    "store_events": store_events[0],
                    "gaps": feed.gaps,
                    "mismatches": feed.mismatches,
                    "mismatches_by": dict(mismatches),
                    "uncovered": getattr(feed, "uncovered", 0),
                    "removed": feed.removed,
                    "store_entries": getattr(feed, "store_entries", 0),
                    "published_kv": feed.published_kv,
                    "published_states": feed.published_states,
                    "events": len(events),
                }
            )
        elif msg[0] == "probe":
            q_out.put(probe.answer(msg[1], msg[2]))
        elif msg[0] == "placement":
            q_out.put({"own": eng.store_segment, "keys": len(put_keys), "endpoints": replica_endpoints(put_keys)})
    eng.close()
    q_out.put("bye")
