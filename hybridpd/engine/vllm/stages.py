"""Router-chosen checkpoints on vLLM: prompt prefixes prefilled first, ``Stages``.

vLLM 0.32 keeps a partial-prefix recurrent state where a prompt ends (its tail
checkpoint, ``MambaManager._cache_partial_tail_block``) and at block
boundaries; it takes no positions from a request. A checkpoint at a position
``p`` the router chose (a junction from the index, a chat boundary, a client's
``hybridpd_checkpoints``) is therefore left by prefilling the prefix whose tail
is ``p`` (``checkpoint_stages.stage_length``: ``p + 1`` tokens, with EAGLE ``p + u +
1``) as a request of its own, one sampled token, before the prompt; the
prompt then hits ``p`` through vLLM's own prefix cache. Several positions run
as a chain of prefixes, each hitting the one before. The engine hands vLLM the
chain and the prompt at once; vLLM's scheduler, ours by subclass, runs them in
order (``sequencer.py``): a prefix is released (finished) as soon as vLLM has run
it up to its last token, its state at ``p`` written and keyed with that chunk, and
the next prefix or the prompt goes on in the next step. This module keeps the
engine's account of them.

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
    """The prefixes of one prompt still in vLLM, and what they found cached."""

    request: EngineRequest
    #: vLLM's id of each prefix not yet done -> (our id of it, its checkpoint position)
    prefixes: dict[str, tuple[str, int]]
    #: the prompt's hit as it arrived: the first prefix that computed past its probe
    #: tokens sets it (None: every prefix was cached, the prompt's own hit counts)
    hit: int | None = None
    #: the checkpoint positions of the prefixes that ran, ascending
    ran: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Stages:
    """Prompts whose prefixes vLLM runs, keyed by the prompt's request id."""

    waiting: dict[str, Staging] = field(default_factory=dict)
    #: prefix vLLM id -> the prompt's request id
    owner: dict[str, str] = field(default_factory=dict)
    #: the hit to report for a prompt whose prefixes computed (request id -> tokens)
    hits: dict[str, int] = field(default_factory=dict)
    #: the checkpoints a prompt's prefixes left (request id -> positions, ascending)
    written: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: prefix requests handed to vLLM (a counter for stats and tests)
    prefixes_run: int = 0
    #: prefixes the scheduler finished before their sampled token (``sequencer.PrefixDone``)
    prefixes_released: int = 0

    @staticmethod
    def prefix_requests(request: EngineRequest, plan: tuple[tuple[int, int], ...]) -> list[EngineRequest]:
        """The prefix requests of ``plan`` (``checkpoint_stages.staged_checkpoints``: each
        ``(position, prefix length)``), in the order they run."""
        return [
            replace(
                request,
                request_id=RequestId("%s%s%d" % (request.request_id, STAGE_SEPARATOR, position)),
                prompt_token_ids=request.prompt_token_ids[:length],
                sampling=PLAIN,
            )
            for position, length in plan
        ]

    def start(self, request: EngineRequest, submitted: list[tuple[str, str, int]]) -> None:
        """``request``'s prefixes are in vLLM: each ``(vLLM id, our id, position)``, in order."""
        if not submitted:
            return
        self.waiting[request.request_id] = Staging(request, {v: (ours, p) for v, ours, p in submitted})
        for vllm_id, _, _ in submitted:
            self.owner[vllm_id] = request.request_id
        self.prefixes_run += len(submitted)

    def done(self, vllm_id: str, cached: int, released: bool) -> str | None:
        """A prefix ran up to its checkpoint with ``cached`` tokens from the cache;
        returns our id of it where the scheduler ``released`` it (vLLM's output
        side still holds it: the engine aborts it there), else None."""
        main = self.owner.pop(vllm_id, None)
        staging = self.waiting.get(main) if main is not None else None
        if staging is None:
            return None
        ours, position = staging.prefixes.pop(vllm_id)
        if staging.hit is None and cached < position:
            staging.hit = cached  # this prefix computed the prompt's own tokens: the hit ends here
        staging.ran.append(position)  # vLLM keyed its state when it ran its last chunk
        self.prefixes_released += released
        if not staging.prefixes:
            del self.waiting[staging.request.request_id]
            if staging.hit is not None:
                self.hits[staging.request.request_id] = staging.hit
            self.written[staging.request.request_id] = tuple(staging.ran)
        return ours if released else None

    def reported_hit(self, request_id: str, hit: int, finished: bool) -> int:
        """The hit to report for a prompt whose own lookup found ``hit`` (the
        prefixes' if one of them computed); ``finished``: forget the prompt."""
        got = self.hits.pop(request_id, hit) if finished else self.hits.get(request_id, hit)
        return min(got, hit)

    def pop_written(self, request_id: str) -> tuple[int, ...]:
        """The checkpoint positions ``request_id``'s prefixes left (once: its first output)."""
        return self.written.pop(request_id, ())

    def abort(self, request_id: str) -> list[str]:
        """Forget ``request_id``'s prefixes; returns our ids of those still in vLLM (to abort there)."""
        staging = self.waiting.pop(request_id, None)
        self.hits.pop(request_id, None)
        self.written.pop(request_id, None)
        if staging is None:
            return []
        for vllm_id in staging.prefixes:
            self.owner.pop(vllm_id, None)
        return [ours for ours, _ in staging.prefixes.values()]
