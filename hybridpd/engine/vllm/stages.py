"""Router-chosen checkpoints on vLLM: prompt prefixes prefilled first, ``Stages``.

vLLM 0.32 keeps a partial-prefix recurrent state where a prompt ends (its tail
checkpoint, ``MambaManager._cache_partial_tail_block``) and at block
boundaries; it takes no positions from a request. A checkpoint at a position
``p`` the router chose (a junction from the index, a chat boundary, a client's
``hybridpd_checkpoints``) is therefore left by prefilling the prefix whose tail
is ``p`` (``checkpoint_stages.stage_length``: ``p + 1`` tokens, with EAGLE ``p + u +
1``) as a request of its own, one sampled token, before the prompt; the
prompt then hits ``p`` through vLLM's own prefix cache. Several positions run
as a chain of prefixes, each hitting the one before. A prefix is released (aborted)
as soon as vLLM has run it up to its last token (``VllmEngine._release_prefixes``):
its state at ``p`` was written and keyed when vLLM scheduled that chunk, and the
next prefix or the prompt goes on in the next step.

Why prefixes and not a scheduler that ends a chunk at ``p``: a chunk split
writes the state at ``p``, but the attention side keeps a sub-block prefix
entry only at a prompt's tail, and a partial entry is dropped when its block
fills (``BlockPool.cache_full_blocks``: partial -> full promotion removes the
block's other keys), so a request sharing ``[0, p)`` would find the state and
no attention hit for it. A prefix's tail survives: the prompt that continues
from it copies the partial block (vLLM's partial-hit copy-on-write) and the
cached block stays as it was. The cost: one engine step per checkpoint (a
chunk split costs the step too; ``u`` extra tokens with EAGLE); a prefix that is
cached already costs its one token. A prefix samples plainly (``PLAIN``):
its token is never reported, so the request's penalties, bias, grammar and
logprobs would be wasted work (``sampling.py``).

Usage reported for the prompt counts only what was cached before it arrived:
a prefix that computed more than its one probe token ends the hit
(``Staging.hit``), so work done for this request is never reported as cached;
the positions of the prefixes that ran come with the prompt's first output
(``Stages.written``: its ``RequestOutput.checkpoints``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hybridpd.engine.base import EngineRequest, RequestId, SamplingParams

#: a prefix request's id is the prompt's id plus this and the checkpoint position
STAGE_SEPARATOR = "::stage@"
#: the background prefix that leaves a P/D prompt's own tail: the prompt's id plus this
TAIL_SUFFIX = "::tail"
#: what a prefix samples: one greedy token, never reported (no penalties, bias, grammar or
#: logprobs: the prompt's own sampling is decode's, or the prompt's once the prefixes ran)
PLAIN = SamplingParams(max_tokens=1, ignore_eos=True)
#: tail stages wait behind at most this many background requests (under steady load
#: they would never run: a later prompt's own tail supersedes an old one's anyway)
TAIL_QUEUE_LIMIT = 64


@dataclass(frozen=True, slots=True)
class TailStage:
    """A P/D prompt's own tail (``checkpoint_stages.truncated_tail_stage``), left by a
    background request (``request``: the prefix, ``background=True``) after it."""

    position: int
    request: EngineRequest


@dataclass(slots=True)
class Staging:
    """The prefixes of one prompt still to run, and what they found cached."""

    request: EngineRequest
    #: (checkpoint position, prefix length) not yet submitted, ascending
    pending: list[tuple[int, int]]
    #: the prefix vLLM runs now: (its request id, its checkpoint position)
    current: tuple[str, int] | None = None
    #: the prompt's hit as it arrived: the first prefix that computed past its probe
    #: tokens sets it (None: every prefix was cached, the prompt's own hit counts)
    hit: int | None = None
    #: the checkpoint positions of the prefixes that ran to their end, ascending
    ran: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Stages:
    """Prompts waiting for their prefixes, keyed by the prompt's request id."""

    waiting: dict[str, Staging] = field(default_factory=dict)
    #: prefix request id -> the prompt's request id
    owner: dict[str, str] = field(default_factory=dict)
    #: the hit to report for a submitted prompt whose prefixes computed (request id -> tokens)
    hits: dict[str, int] = field(default_factory=dict)
    #: the checkpoints a submitted prompt's prefixes left (request id -> positions, ascending)
    written: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: prefix requests started (a counter for stats and tests)
    prefixes_run: int = 0
    #: prefixes released before their sampled token (``VllmEngine._release_prefixes``)
    prefixes_released: int = 0

    def start(self, request: EngineRequest, plan: tuple[tuple[int, int], ...]) -> EngineRequest | None:
        """Queue ``request`` behind ``plan`` (``checkpoint_stages.staged_checkpoints``);
        returns the first prefix request to submit (None: no plan, submit the prompt)."""
        if not plan:
            return None
        staging = Staging(request, list(plan))
        self.waiting[request.request_id] = staging
        return self._next(staging)

    def _next(self, staging: Staging) -> EngineRequest | None:
        if not staging.pending:
            staging.current = None
            return None
        position, length = staging.pending.pop(0)
        rid = "%s%s%d" % (staging.request.request_id, STAGE_SEPARATOR, position)
        staging.current = (rid, position)
        self.owner[rid] = staging.request.request_id
        self.prefixes_run += 1
        prefix = staging.request.prompt_token_ids[:length]
        return replace(staging.request, request_id=RequestId(rid), prompt_token_ids=prefix, sampling=PLAIN)

    def is_prefix(self, request_id: str) -> bool:
        return request_id in self.owner

    def finished(self, request_id: str, cached: int) -> EngineRequest | None:
        """A prefix request finished with ``cached`` tokens from the cache. Returns
        the next request to submit: the next prefix, or the prompt itself (whose
        id is not a prefix's: ``is_prefix``); None if the prompt was aborted."""
        main = self.owner.pop(request_id)
        staging = self.waiting.get(main)
        if staging is None or staging.current is None or staging.current[0] != request_id:
            return None
        if staging.hit is None and cached < staging.current[1]:
            staging.hit = cached  # this prefix computed the prompt's own tokens: the hit ends here
        staging.ran.append(staging.current[1])  # vLLM keyed its state when it ran its last token
        nxt = self._next(staging)
        if nxt is not None:
            return nxt
        del self.waiting[main]
        if staging.hit is not None:
            self.hits[main] = staging.hit
        self.written[main] = tuple(staging.ran)
        return staging.request

    def reported_hit(self, request_id: str, hit: int, finished: bool) -> int:
        """The hit to report for a prompt whose own lookup found ``hit`` (the
        prefixes' if one of them computed); ``finished``: forget the prompt."""
        got = self.hits.pop(request_id, hit) if finished else self.hits.get(request_id, hit)
        return min(got, hit)

    def pop_written(self, request_id: str) -> tuple[int, ...]:
        """The checkpoint positions ``request_id``'s prefixes left (once: its first output)."""
        return self.written.pop(request_id, ())

    def abort(self, request_id: str) -> str | None:
        """Forget ``request_id``'s prefixes; returns the prefix request vLLM is
        running for it (to abort there), if any."""
        staging = self.waiting.pop(request_id, None)
        self.hits.pop(request_id, None)
        self.written.pop(request_id, None)
        if staging is None or staging.current is None:
            return None
        self.owner.pop(staging.current[0], None)
        return staging.current[0]
