"""A server's tokenization as the multi-turn benchmark needs it (``Encoders``):
chat messages and text to ids, the ids an answer's text leaves out, and how
many of an answer's ids the router keeps (``kept_tokens``).

Contract: ``native_encoders`` / ``router_encoders`` tokenize as our router does
(the bundled model's, or a model directory's tokenizer files); a vLLM server's
is built from its ``/tokenize`` (``bench.multi_turn_run``), with the fields it
cannot give left None.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from bench.multi_turn import TextEncoder

Messages = list[tuple[str, str]]
ChatIds = Callable[[Messages], list[int]]


@dataclasses.dataclass(frozen=True)
class Encoders:
    """A server's tokenization: chat messages -> prompt ids, text -> ids; ``stop_ids``
    (stripped from an answer's end before comparing it with its re-tokenized text,
    as the router does) and ``special_ids`` (ids that decode to no text; None: unknown)."""

    chat_ids: ChatIds
    text_ids: TextEncoder
    stop_ids: tuple[int, ...] = ()
    special_ids: frozenset[int] | None = None
    #: messages ending in (assistant answer, user message) -> the prompt's tokens after
    #: the answer's text (template + message + generation prompt), tokenized alone
    suffix_tokens: Callable[[Messages], int] | None = None
    #: ids -> their text (the router's tokenizer; None: unknown)
    decode: Callable[[list[int]], str] | None = None


def native_encoders() -> Encoders:
    """The router's tokenization (the bundled model's assets)."""
    from hybridpd.model_files import TOKENIZER_DIR

    return router_encoders(TOKENIZER_DIR)


def router_encoders(tokenizer_dir: Path) -> Encoders:
    """The router's tokenization of the model whose tokenizer files are in ``tokenizer_dir``."""
    from hybridpd.tokenizer import ChatMessage, TextTokenizer

    tok = TextTokenizer(tokenizer_dir)
    special = frozenset(i for i, t in tok.tok.get_added_tokens_decoder().items() if t.special)

    def suffix_tokens(msgs: Messages) -> int:
        # the template ends a turn with <|im_end|>, a special token: the text after the
        # answer tokenizes the same alone as in the whole prompt
        text = tok.chat_prompt([ChatMessage(r, c) for r, c in msgs]).text
        answer = msgs[-2][1]
        return len(tok.encode(text[text.rfind(answer) + len(answer) :]))

    return Encoders(
        lambda msgs: tok.apply_chat_template([ChatMessage(r, c) for r, c in msgs]),
        tok.encode,
        tuple(tok.stop_token_ids),
        special,
        suffix_tokens,
        tok.decode,
    )


def kept_tokens(ids: list[int], decode: Callable[[list[int]], str], text: str) -> int:
    """How many of an answer's generated ``ids`` the router keeps as the answer:
    the most leading ids whose text is exactly the ``text`` the client got (all of
    them, unless the answer ends inside a character: the router then keeps the ids
    before the cut, ``IncrementalDetokenizer.received``; none where no prefix is).

    >>> kept_tokens([1, 2, 3], lambda ids: "abc"[: len(ids)], "abc")
    3
    >>> kept_tokens([1, 2, 3], lambda ids: ["", "a", "ab", "ab\ufffd"][len(ids)], "ab")
    2
    >>> kept_tokens([1, 2], lambda ids: "x", "y")
    0
    """
    for k in range(len(ids), 0, -1):
        if decode(ids[:k]) == text:
            return k
    return 0
