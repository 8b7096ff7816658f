"""Output processing for one request: token ids in, :class:`Event`s out.

    token ids (the prefill's, possibly none; then each decode chunk)
      -> IncrementalDetokenizer.push           text delta (a split character held back)
      -> StopWindow.find on the tail it touched the earliest stop string, if any
      -> Event                                 the text up to a stop string, minus a
                                               tail that may start one (held back
                                               until it does not); usage on the last one

Tensor-free and actor-free: unit-tested on token ids alone.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hybridpd.engine.base import TokenLogprobs
from hybridpd.tokenizer import IncrementalDetokenizer, TextTokenizer


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    #: why the prompt's tokens were (not) restored (``prefix_outcomes.prefix_token_split``);
    #: None when the request was not looked up in the index
    prefix_tokens: Mapping[str, int] | None = None
    #: the hit the index lookup promised on the instance the request was routed to
    #: (None when it was not looked up); ``cached_tokens`` below it is a broken promise
    promised_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Event:
    """What both APIs send for one step of a request: the new tokens and their
    text; the last event has ``finished``, a ``finish_reason`` and ``usage``."""

    token_ids: tuple[int, ...]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    usage: Usage | None = None
    #: per token of ``token_ids``, when the request asked for logprobs
    logprobs: tuple[TokenLogprobs, ...] | None = None
    #: on the last event: the stop string, or the client's stop token id, that ended it (vLLM's)
    stop_reason: str | int | None = None


@dataclass(frozen=True, slots=True)
class OutputOptions:
    """How a request's tokens become its text (vLLM's fields of the same names)."""

    stop: tuple[str, ...] = ()
    #: the stop string, or the stop token's text, stays in the text
    include_stop_str_in_output: bool = False
    #: stop strings count only after this many tokens' text
    min_tokens: int = 0
    skip_special_tokens: bool = True
    #: the client's own stop token ids (the ``stop_reason`` they give)
    stop_token_ids: tuple[int, ...] = ()


class StopWindow:
    """The earliest stop string in a text that only grows at its end, found by
    searching only the tail an append can have completed.

    Contract: call :meth:`find` after every append, passing the length the text
    had before it, and stop at the first hit. Then no earlier call found a stop
    string, so one present now ends in the appended part and starts at most
    ``max(len(s)) - 1`` characters before it: the answer equals searching the
    whole text (what ``str.find`` over it would give, earliest of all stop
    strings), in time proportional to the append plus that reach, not to the text.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = tuple(s for s in stop if s)
        self.reach = max((len(s) for s in self.stop), default=1) - 1

    def find(self, text: str, appended_at: int, floor: int = 0) -> int | None:
        """Index in ``text`` where the earliest stop string starts, or None;
        ``text[:appended_at]`` was searched by the previous calls. ``floor``: no
        stop string starting before it counts (min_tokens)."""
        hit = self.match(text, appended_at, floor)
        return hit[0] if hit is not None else None

    def match(self, text: str, appended_at: int, floor: int = 0) -> tuple[int, str] | None:
        """The stop string in ``text`` that completes first (ties: the earlier in the list,
        vLLM's ``check_stop_strings``) and where it starts; only one that ends after
        ``floor`` counts (``min_tokens``' exempt text)."""
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            i = text.find(s, max(appended_at - self.reach, floor - len(s) + 1, 0))
            if i >= 0 and (best is None or i + len(s) < best[0]):
                best = (i + len(s), i, s)
        return (best[1], best[2]) if best is not None else None

    def held(self, text: str) -> int:
        """How many characters at the end of ``text`` could be the start of a stop
        string (the longest suffix that is a proper prefix of one): held back
        from the client until the text goes on, ends, or completes the stop string."""
        for k in range(min(self.reach, len(text)), 0, -1):
            tail = text[len(text) - k :]
            if any(len(s) > k and s.startswith(tail) for s in self.stop):
                return k
        return 0


class OutputProcessor:
    """One request's output. Feed :meth:`push` the prefill's tokens, then every
    decode chunk, until it returns a finished Event; not reusable."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        stop: Sequence[str] | OutputOptions,
        prompt_tokens: int,
        cached_tokens: int,
        prefix_tokens: Mapping[str, int] | None = None,
        promised_tokens: int | None = None,
    ) -> None:
        opts = stop if isinstance(stop, OutputOptions) else OutputOptions(tuple(stop))
        self.opts = opts
        self.detok = IncrementalDetokenizer(tokenizer, opts.skip_special_tokens)
        self.stop = StopWindow(opts.stop)
        #: where stop strings may start: the text of the first ``min_tokens`` tokens is exempt
        self.floor = 0
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens
        self.prefix_tokens = prefix_tokens
        self.promised_tokens = promised_tokens
        #: output tokens received so far (all of a chunk count, even past a stop string)
        self.count = 0
        #: the request ended on a stop string: the client did not get every token
        self.stopped_on_string = False
        #: characters of ``detok.emitted`` sent to the client
        self.sent = 0

    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, self.cached_tokens, self.count, self.prefix_tokens, self.promised_tokens)

    def push(
        self,
        token_ids: tuple[int, ...],
        done: bool,
        finish_reason: str | None,
        logprobs: tuple[TokenLogprobs, ...] | None = None,
    ) -> Event:
        """The Event for ``token_ids``: finished with reason "stop" (its text cut
        before the stop string, or after it with ``include_stop_str_in_output``)
        when they completed one; else finished with ``finish_reason`` when ``done``
        (the engine ended the request; on "stop" the stop token's text is left
        out unless ``include_stop_str_in_output``, as vLLM does); else the new
        text, less a tail that may be the start of a stop string (as OpenAI and
        vLLM hold it back: a client never sees "STO" of "STOP")."""
        opts = self.opts
        before, count = len(self.detok.emitted), self.count
        text_ids = token_ids
        stop_token = done and finish_reason == "stop" and bool(token_ids)
        if stop_token and not opts.include_stop_str_in_output:
            text_ids = token_ids[:-1]
        # the text's end after each token (vLLM's token_offsets): one push per token where a stop
        # string could end inside a chunk, so the tokens after the one completing it are dropped
        offsets = [before]
        if self.stop.stop and len(text_ids) > 1:
            for i, t in enumerate(text_ids):
                self.detok.push((t,), final=done and i == len(text_ids) - 1)
                offsets.append(len(self.detok.emitted))
        else:
            self.detok.push(text_ids, final=done)
            offsets += [len(self.detok.emitted)] * len(text_ids)
        offsets += [offsets[-1]] * (len(token_ids) - len(text_ids))  # a stop token's, left out of the text
        self.count += len(token_ids)
        text = self.detok.emitted
        if self.count <= opts.min_tokens:  # stop strings count only after min_tokens tokens' text
            self.floor = len(text)
        elif count < opts.min_tokens:
            self.floor = offsets[opts.min_tokens - count]
        hit = self.stop.match(text, before, self.floor) if self.count > opts.min_tokens else None
        if hit is not None:
            self.stopped_on_string = True
            at, s = hit
            kept = bisect.bisect_left(offsets, at + len(s), lo=1)  # through the token completing it
            self.count = count + kept
            lps = logprobs[:kept] if logprobs is not None else None
            end = at + len(s) if opts.include_stop_str_in_output else at
            return Event(token_ids[:kept], self._release(end), True, "stop", self.usage(), lps, s)
        if done:
            reason = token_ids[-1] if stop_token and token_ids[-1] in opts.stop_token_ids else None
            return Event(token_ids, self._release(len(text)), True, finish_reason, self.usage(), logprobs, reason)
        held = 0 if opts.include_stop_str_in_output else self.stop.held(text)
        return Event(token_ids, self._release(len(text) - held), logprobs=logprobs)

    def _release(self, upto: int) -> str:
        """The text from what was sent up to ``upto``, now sent."""
        upto = max(upto, self.sent)
        out = self.detok.emitted[self.sent : upto]
        self.sent = upto
        return out
