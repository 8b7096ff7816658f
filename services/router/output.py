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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hybridpd.tokenizer import IncrementalDetokenizer, TextTokenizer


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    #: why the prompt's tokens were (not) restored (``checkpoints.prefix_token_split``);
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

    def find(self, text: str, appended_at: int) -> int | None:
        """Index in ``text`` where the earliest stop string starts, or None;
        ``text[:appended_at]`` was searched by the previous calls."""
        lo = max(appended_at - self.reach, 0)
        hits = [i for i in (text.find(s, lo) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

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
        stop: Sequence[str],
        prompt_tokens: int,
        cached_tokens: int,
        prefix_tokens: Mapping[str, int] | None = None,
        promised_tokens: int | None = None,
    ) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop = StopWindow(stop)
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

    def push(self, token_ids: tuple[int, ...], done: bool, finish_reason: str | None) -> Event:
        """The Event for ``token_ids``: finished with reason "stop" (its text cut
        before the stop string) when they completed one; else finished with
        ``finish_reason`` when ``done`` (the engine ended the request); else the
        new text, less a tail that may be the start of a stop string (as OpenAI
        and vLLM hold it back: a client never sees "STO" of "STOP")."""
        before = len(self.detok.emitted)
        self.detok.push(token_ids, final=done)
        self.count += len(token_ids)
        text = self.detok.emitted
        at = self.stop.find(text, before)
        if at is not None:
            self.stopped_on_string = True
            return Event(token_ids, self._release(at), True, "stop", self.usage())
        if done:
            return Event(token_ids, self._release(len(text)), True, finish_reason, self.usage())
        return Event(token_ids, self._release(len(text) - self.stop.held(text)))

    def _release(self, upto: int) -> str:
        """The text from what was sent up to ``upto``, now sent."""
        upto = max(upto, self.sent)
        out = self.detok.emitted[self.sent : upto]
        self.sent = upto
        return out
