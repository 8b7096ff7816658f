"""Answer checkpoints, router side: the answer becomes part of the
cached prefix.

When a chat request finishes normally, two things happen here:

1. **the answer checkpoint**: the router asks the prefill instance that
   served the prompt (it holds the prompt's checkpoint) to prefill prompt +
   answer at low priority (``PrefillWorker.answer``: a background request
   through the ordinary chunked prefill, so what a later hit restores is
   what a one-shot prefill of those tokens computes: exact in fp32);
2. **the answer memory**: the text the client received, appended to the
   rendered prompt, is remembered with the ids the model generated
   (:class:`AnswerMemory`). The next turn's chat prompt renders the answer as
   text; where re-tokenizing that text would give other ids, the remembered
   ids stand for it (``TextTokenizer.chat_prompt(recall=...)``), so the
   next prompt continues exactly the ids the checkpoint covers.

Nothing is done for a request that was cancelled, failed, or ended on a stop
string (the client did not receive every token, so no checkpoint may cover
them), nor when the answer would not fit the context.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AnswerPlan:
    """What a chat request needs at its end to make its answer reusable."""

    #: the tenant's cache salt (memory entries are per salt: tenants never share)
    salt: str | None
    #: the rendered prompt text (generation prompt included)
    prompt_text: str
    #: where a recalled answer's ids lie in this prompt (the answer-hit metric)
    answer_span: tuple[int, int] | None = None


class AnswerMemory:
    """Bounded LRU: (salt, text up to the end of an answer) -> (ids, answer start).

    ``max_tokens`` bounds the ids held in all entries together (a long
    conversation's entry holds its whole prompt). Keys are SHA-256 digests of
    salt and text: the text itself is not kept. Thread-safe.
    """

    def __init__(self, max_entries: int = 4096, max_tokens: int = 4 << 20) -> None:
        self.max_entries, self.max_tokens = max_entries, max_tokens
        # NOTE: ids as int32 arrays: 4 bytes a token, not a tuple's ~36
        self._entries: OrderedDict[bytes, tuple[array[int], int]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _key(salt: str | None, text: str) -> bytes:
        h = hashlib.sha256()
        h.update((salt or "").encode())
        h.update(b"\0" if salt is None else b"\1")
        h.update(text.encode())
        return h.digest()

    def remember(self, salt: str | None, text: str, ids: Sequence[int], answer_start: int) -> None:
        key = self._key(salt, text)
        value = (array("i", ids), answer_start)
        if len(value[0]) > self.max_tokens:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._tokens -= len(old[0])
            self._entries[key] = value
            self._tokens += len(value[0])
            while len(self._entries) > self.max_entries or self._tokens > self.max_tokens:
                _, dropped = self._entries.popitem(last=False)
                self._tokens -= len(dropped[0])

    def recall(self, salt: str | None, text: str) -> tuple[Sequence[int], int] | None:
        key = self._key(salt, text)
        with self._lock:
            got = self._entries.get(key)
            if got is not None:
                self._entries.move_to_end(key)
            return got


def strip_stop(ids: Sequence[int], stop_token_ids: Sequence[int]) -> tuple[int, ...]:
    """``ids`` without a trailing stop token: the chat template renders the
    end of the turn itself (the next prompt's text continues with it)."""
    out = tuple(ids)
    return out[:-1] if out and out[-1] in stop_token_ids else out
