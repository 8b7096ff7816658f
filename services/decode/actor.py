"""Decode actor: fetches a handoff, decodes (EAGLE), streams tokens.

The handoff ticket is opaque here: the engine holds what it has of the
prompt (``Engine.prepare_handoff``, under the engine lock: the native engine
pins the KV blocks its prefix cache keeps from the conversation's previous
turns), then fetches the rest (``Engine.fetch_handoff``: the native engine
READs the other KV blocks + state + EAGLE hidden over NIXL and verifies their
checksums; vLLM's connector pulls during steps).

With a Redis URL the engine's cache events (the handed-off prompts' blocks
it keeps) are mirrored into this instance's index entries
(``worker/index_mirror.py``): the router sends a conversation's next turn to
the decode instance that holds its previous ones (``routing.choose_decode``).

``generate`` is a generator (a Ray streaming generator): the actor yields
:class:`TokenChunk` objects as the engine produces them (``token_channel: ray``),
the last one with ``finished`` set; or it sends them as frames to the router's
token sink (``worker/token_channel.py``), the last one as the stream's end frame
and a failure as its error frame, and yields nothing. ``abort``, or the caller
cancelling the call, frees the request's blocks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import asdict

from hybridpd.config import HybridPDConfig
from hybridpd.engine.base import Engine, EngineRequest, HandoffTicket
from hybridpd.engine.factory import make_engine
from hybridpd.errors import IntegrityError, InvalidRequestError, OverloadedError, UnavailableError
from hybridpd.index.prefix_index import PrefixIndex
from hybridpd.integrity import TagError, load_key
from services.worker.base import WorkerBase, ray_metrics, startup_guard
from services.worker.engine_loop import EngineLoop
from services.worker.index_mirror import IndexMirror
from services.worker.messages import PrefillResult, TokenChunk
from services.worker.metrics import DECODE_COUNTERS, DECODE_GAUGES, DECODE_HISTOGRAMS, DecodeCounters
from services.worker.token_channel import FrameStream, TokenSender

logger = logging.getLogger(__name__)

#: a handoff waits at most this long for KV blocks on a full decode engine, then fails
KV_WAIT_S = 30.0
KV_WAIT_POLL_S = 0.02


class DecodeWorker(WorkerBase):
    """The actor's body (plain class, so tests can also run it in-process).

    ``engine``: tests pass an engine built elsewhere; actors build theirs from ``cfg``."""

    counters: DecodeCounters

    #: how often the index entries' TTL is refreshed (the index keeps them an hour)
    REFRESH_S = 600.0

    def __init__(
        self, cfg: HybridPDConfig, name: str, redis_url: str | None = None, *, engine: Engine | None = None
    ) -> None:
        with startup_guard(name):
            self._start(cfg, name, redis_url, engine)

    def _start(self, cfg: HybridPDConfig, name: str, redis_url: str | None, engine: Engine | None) -> None:
        self.cfg = cfg
        self.name = name
        self.engine = engine or make_engine(cfg, "decode", instance=name)
        self.stats_lock = threading.Lock()
        self.counters = DecodeCounters()
        self.index = (
            PrefixIndex(redis_url, self.engine.model_id, cluster=cfg.redis_cluster)
            if redis_url and cfg.enable_prefix_caching
            else None
        )
        self.mirror = IndexMirror(name, self.index, self.counters, self.stats_lock) if self.index else None
        self.loop = EngineLoop(self.engine, after_step=self._collect_events)
        self.sender = TokenSender(load_key(cfg), cfg.max_token_frame_bytes)
        self._stop = threading.Event()
        if self.index is not None:
            threading.Thread(target=self._refresh, name="index-refresh", daemon=True).start()
        self.metrics = ray_metrics(name, DECODE_COUNTERS, DECODE_GAUGES, DECODE_HISTOGRAMS)
        if self.metrics is not None:
            self.metrics.run(self._metric_snapshot, self._stop)

    def _collect_events(self) -> None:
        """After each step (loop thread, engine lock): the cache events, to the index."""
        events = self.engine.pop_cache_events()
        if events and self.mirror is not None:
            self.mirror.add(events)

    def _refresh(self) -> None:
        while not self._stop.wait(self.REFRESH_S):
            try:
                assert self.index is not None
                self.index.refresh_local(self.name)
            except UnavailableError:
                logger.debug("index refresh failed: index unavailable")

    def generate(
        self, prefill: PrefillResult, request: EngineRequest, sink: str | None = None, stream: str | None = None
    ) -> Iterator[TokenChunk]:
        """Continue ``request`` from its prefill; yields chunks until finished (raises what
        stopped it), or with ``sink`` (a router's ``TokenSink`` address) sends all of the
        stream there as frames of ``stream`` (``SinkStream.key``; the request id if None),
        its end or its error included, and yields nothing (``token_channel.py``)."""
        if sink is not None:
            self._send(prefill, request, self.sender.stream(sink, stream or request.request_id, request.request_id))
            return
        self.refuse_if_draining()
        with self.engine_errors():
            yield from self._generate(prefill, request)

    def _send(self, prefill: PrefillResult, request: EngineRequest, out: FrameStream) -> None:
        """The stream as frames: each chunk (the last as the end frame), or an error frame.
        A cancelled call (the router closed the stream) stops between chunks, freeing the
        request. Raises only what could not be sent (the sink is gone or full)."""
        try:
            self.refuse_if_draining()
            with self.engine_errors():
                chunks = self._generate(prefill, request)
                try:
                    for chunk in chunks:
                        out.send(chunk)
                        if _cancelled():
                            return
                finally:
                    chunks.close()  # a stream left early is aborted here (``_generate``)
        except Exception as exc:
            out.fail(exc)

    def _fetch(self, prefill: PrefillResult, request: EngineRequest) -> HandoffTicket | None:
        """The handoff's bytes, moved and verified by the engine (outside the engine lock);
        None when the request was aborted already (nothing pinned, nothing read)."""
        ticket = prefill.ticket
        if ticket is None:
            raise InvalidRequestError("request %s has no handoff to continue" % request.request_id)
        t0 = time.perf_counter()
        with self.loop.lock:
            # NOTE: under the lock that pins: an abort after this check finds the pins (and frees them)
            if self.loop.aborted(request.request_id):
                return None
            held = self.engine.prepare_handoff(request, ticket)
        try:
            fetched = self.engine.fetch_handoff(request, ticket)
        except BaseException as exc:
            if held:
                with self.loop.lock:
                    self.engine.abort(request.request_id)  # releases what prepare_handoff held
            if isinstance(exc, TagError):  # not offered with this deployment's key: never read
                with self.stats_lock:
                    self.counters.handoff_tag_failures += 1
            elif isinstance(exc, IntegrityError):
                with self.stats_lock:
                    self.counters.checksum_failures += 1
            raise
        read = fetched.nbytes  # a delta handoff: less than the ticket's
        with self.stats_lock:
            self.counters.decode_handoffs += 1
            self.counters.nixl_read_bytes += read
            self.counters.handoff_skipped_bytes += max(0, ticket.nbytes - read)
            self.counters.delta_handoffs += 1 if held else 0
        if self.metrics is not None and ticket.nbytes:
            self.metrics.observe("nixl_read_seconds", time.perf_counter() - t0)
            self.metrics.observe("handoff_bytes", read)
        return fetched

    def _generate(self, prefill: PrefillResult, request: EngineRequest) -> Generator[TokenChunk, None, None]:
        with self.loop.reserved(request.request_id):  # an abort during the fetch is not lost
            try:
                fetched = self._fetch(prefill, request)

                def add() -> None:
                    assert fetched is not None  # None only when aborted: submit then never calls add
                    self.engine.add_handoff(request, fetched)

                q = self._submit_when_room(request, add)
            except BaseException:  # whatever stopped it (a cancel included) leaves no block pinned
                self.loop.abort(request.request_id)
                raise
        try:
            while True:
                chunk = _next_chunk(q, request.request_id)
                with self.stats_lock:
                    self.counters.decode_tokens += len(chunk.token_ids)
                yield chunk
                if chunk.finished:
                    return
        finally:
            # a consumer that went away (client disconnect) ends up here too
            self.loop.abort(request.request_id)

    def _submit_when_room(self, request: EngineRequest, add: Callable[[], None]) -> queue.Queue:
        """``loop.submit`` of ``add``; while the engine has no KV blocks for it
        (OverloadedError: what it holds of the prompt stays pinned), try again as
        requests finish, for at most ``KV_WAIT_S``: a started stream waits for room
        instead of failing. Counted in ``kv_waits``."""
        waited_from: float | None = None
        while True:
            try:
                return self.loop.submit(request.request_id, add)
            except OverloadedError:
                now = time.monotonic()
                if waited_from is None:
                    waited_from = now
                    with self.stats_lock:
                        self.counters.kv_waits += 1
                if now - waited_from > KV_WAIT_S or self.loop.aborted(request.request_id):
                    raise
                time.sleep(KV_WAIT_POLL_S)

    def abort(self, request_id: str) -> bool:
        return self.loop.abort(request_id)

    def _metric_snapshot(self) -> tuple[dict[str, float], dict[str, float]]:
        with self.loop.lock:
            pool = self.engine.stats()
            spec = self.engine.spec
            steps, emitted, recent = spec.steps, spec.emitted, spec.drain()
        if self.metrics is not None:
            for n in recent:
                self.metrics.observe("eagle_acceptance_length", n)
        with self.stats_lock:
            self.counters.eagle_steps, self.counters.eagle_emitted_tokens = steps, emitted
            counters: dict[str, float] = asdict(self.counters)
        return counters, {"decode_running_requests": pool.num_running, "free_kv_blocks": pool.num_free_blocks}

    def stats(self) -> dict[str, object]:
        with self.loop.lock:
            acc = self.engine.spec.mean_acceptance_length
        with self.stats_lock:
            n, read = self.counters.decode_handoffs, self.counters.nixl_read_bytes
        return {
            **self._base_stats(),
            "eagle_mean_acceptance_length": acc,
            "handoff_bytes_per_request": read / n if n else 0.0,
        }

    def close(self) -> None:
        self._stop.set()
        self.loop.close()
        self.sender.close()
        if self.mirror is not None:
            self.mirror.close()
        self.engine.close()


def _next_chunk(q: queue.Queue, request_id: str, stall_s: float = 600.0) -> TokenChunk:
    """Block for the next engine output of ``request_id``, then merge every
    output already waiting behind it into one chunk: when the engine produces
    tokens faster than the router reads the stream (the router bounds how far
    the generator may run ahead), they cross Ray as one object, not one each."""
    try:
        outs = [q.get(timeout=stall_s)]
    except queue.Empty:
        raise TimeoutError("decode of %s stalled" % request_id) from None
    while not (isinstance(outs[-1], BaseException) or outs[-1].finished):
        try:
            outs.append(q.get_nowait())
        except queue.Empty:
            break
    if isinstance(outs[-1], BaseException):
        raise outs[-1]
    last = outs[-1]
    tokens = tuple(t for o in outs for t in o.new_token_ids)
    lps = tuple(lp for o in outs for lp in (o.logprobs or ())) if any(o.logprobs for o in outs) else None
    return TokenChunk(tokens, last.finished, None if last.finish_reason is None else str(last.finish_reason), lps)


def _cancelled() -> bool:
    """Whether the Ray call this thread runs was cancelled (``ray.cancel``, which a
    threaded actor's running task only reads); False outside a Ray worker."""
    import ray

    if not ray.is_initialized():
        return False
    try:
        return ray.get_runtime_context().is_canceled()
    except RuntimeError:  # a driver: the worker runs in-process
        return False
