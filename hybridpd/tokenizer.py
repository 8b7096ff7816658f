"""Tokenization for serving: text <-> ids, chat templates, streaming detokenization.

Wraps a HuggingFace ``tokenizers`` file plus a ``tokenizer_config.json``
(chat template as a Jinja string, stop tokens), as shipped in a model
directory. Shared by the router and the engines.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer

from hybridpd.chat_template import compile_template, special_tokens
from hybridpd.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str
    #: the participant's name (OpenAI's ``name``), passed to the template when set
    name: str | None = None

    def as_dict(self) -> dict[str, str]:
        """The message as a chat template sees it."""
        d = {"role": self.role, "content": self.content}
        if self.name is not None:
            d["name"] = self.name
        return d


#: how many of a chat's last assistant messages ``chat_prompt`` asks its ``recall`` for
RECALL_TRIES = 4
#: the ``generation_config.json`` fields that default a request's sampling (vLLM's
#: ``ModelConfig.get_diff_sampling_param``)
GENERATION_FIELDS = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
)


class TextTokenizer:
    def __init__(self, model_dir: Path) -> None:
        self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        # NOTE: a chat template is code shipped with the model: it renders sandboxed, as
        # Hugging Face renders it (chat_template.py)
        self.template = compile_template(cfg["chat_template"]) if cfg.get("chat_template") else None
        self.special_tokens = special_tokens(cfg)
        gen_path = model_dir / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
        #: the model's sampling defaults (``generation_config.json``, as vLLM's server reads it with
        #: ``generation_config: auto``): what a request that leaves a field out gets
        self.generation_defaults: dict[str, float] = {
            ("max_tokens" if k == "max_new_tokens" else k): gen[k] for k in GENERATION_FIELDS if gen.get(k) is not None
        }
        self.stop_token_ids = tuple(
            i for i in (self.tok.token_to_id(t) for t in cfg.get("stop_tokens", [])) if i is not None
        )
        self.vocab_size = self.tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_str(self, token_id: int) -> str:
        """One token's vocabulary string (vLLM's ``/tokenize`` ``token_strs``: ``convert_ids_to_tokens``)."""
        return self.tok.id_to_token(token_id) or ""

    def token_text(self, token_id: int) -> str:
        """One token's text as logprobs name it (vLLM: ``tokenizer.decode([id])``, special tokens kept)."""
        return self.tok.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self._render(messages, ChatOptions(add_generation_prompt)))

    def _render(self, messages: Sequence[ChatMessage], opts: ChatOptions) -> str:
        """The template's text for ``messages`` (Jinja sandboxed). ``continue_final_message``:
        cut after the last message's content, as Hugging Face's ``apply_chat_template`` does,
        so the model continues it; InvalidRequestError where the template drops that content."""
        if self.template is None:
            raise InvalidRequestError("this model has no chat template; use /v1/completions")
        reserved = {"messages", "add_generation_prompt", "tools", "documents"} & set(opts.template_kwargs)
        if reserved:
            raise InvalidRequestError("chat_template_kwargs may not set %s" % ", ".join(sorted(reserved)))
        try:
            text = self.template.render(
                **{**self.special_tokens, **opts.template_kwargs},
                messages=[m.as_dict() for m in messages],
                add_generation_prompt=opts.add_generation_prompt,
                tools=[dict(t) for t in opts.tools] if opts.tools is not None else None,
            )
        except jinja2.TemplateError as exc:  # a kwarg the template needs but did not get, a sandbox refusal
            raise InvalidRequestError("chat template: %s" % exc) from None
        if not opts.continue_final_message:
            return text
        final = messages[-1].content
        if final.strip() not in text:
            raise InvalidRequestError(
                "continue_final_message: the chat template does not render the final message's content"
            )
        at = text.rindex(final.strip())
        if text[at : at + len(final.lstrip())] == final:
            return text[: at + len(final.lstrip())]
        return text[: at + len(final.strip())]

    def chat_prompt(
        self,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool | ChatOptions = True,
        recall: Callable[[str], tuple[Sequence[int], int] | None] | None = None,
    ) -> ChatPrompt:
        """The chat prompt's ids, its rendered text and where its turns begin.

        ``boundaries`` (token counts, ascending, each in ``(0, len(ids))``): the
        start of the content of the first message after the leading system
        message(s) (the system prompt and the template's header of the next
        turn are what every conversation with that system prompt shares), and
        the start of the content of the last user message (what a regenerated
        or edited last turn shares). A boundary inside a token counts that
        token out (the position is where the last token that ends at or before
        the content starts ends), so the prefix before it tokenizes alike in
        every prompt that shares it. None when the template does not render
        the contents verbatim.

        ``recall(text)``: the ids of a conversation whose rendered text up to
        the end of an answer is ``text``, the answer's ids as this model
        generated them (the router's answer memory), and where the answer
        starts among them; or None. When it knows the text up to the end of the
        last assistant message, or else of one of the :data:`RECALL_TRIES` last
        ones (the last answer was not kept, or edited), those ids stand for it,
        and only the rest is tokenized: the prompt continues the exact ids the
        engine computed, which re-tokenizing the answers' text need not
        reproduce (``answer_span`` then says where that answer's ids lie).
        """
        opts = (
            add_generation_prompt
            if isinstance(add_generation_prompt, ChatOptions)
            else ChatOptions(add_generation_prompt)
        )
        text = self._render(messages, opts)
        starts: list[int] = []  # char offset where each message's content starts
        at = 0
        for m in messages:
            i = text.find(m.content, at)
            if i < 0:
                return ChatPrompt(self.encode(text), text)
            starts.append(i)
            at = i + len(m.content)
        head: Sequence[int] = ()
        cut = 0  # chars of ``text`` that ``head`` stands for
        span = None
        answers = [i for i, m in enumerate(messages) if m.role == "assistant"][::-1][:RECALL_TRIES]
        for i in answers:
            if recall is None:
                break
            end = starts[i] + len(messages[i].content)
            got = recall(text[:end])
            if got is not None:
                head, cut = got[0], end
                span = (got[1], len(head))
                break
        enc = self.tok.encode(text[cut:], add_special_tokens=opts.add_special_tokens and not cut)
        n_sys = 0
        while n_sys < len(messages) and messages[n_sys].role == "system":
            n_sys += 1
        chars = set()
        if 0 < n_sys < len(messages):
            chars.add(starts[n_sys])
        last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
        if last_user > 0:
            chars.add(starts[last_user])
        ends = [e for _, e in enc.offsets]
        ids = [*head, *enc.ids]
        out = {len(head) + bisect.bisect_right(ends, c - cut) for c in chars if c >= cut}
        return ChatPrompt(ids, text, tuple(sorted(p for p in out if 0 < p < len(ids))), span)


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """How a chat renders (vLLM's request fields of the same names)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    #: extra variables for the template (e.g. ``enable_thinking``)
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    #: the tokenizer's special tokens (a BOS) around the rendered text
    add_special_tokens: bool = False
    #: tool definitions (OpenAI's ``tools``) for the template's ``tools`` variable
    tools: tuple[Mapping[str, Any], ...] | None = None


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A rendered chat prompt (:meth:`TextTokenizer.chat_prompt`)."""

    ids: list[int]
    #: the rendered text (generation prompt included)
    text: str
    #: where turns begin, token counts (checkpoint positions)
    boundaries: tuple[int, ...] = ()
    #: where the recalled answer's ids lie in ``ids`` (None: nothing recalled)
    answer_span: tuple[int, int] | None = None


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas without splitting a
    multi-byte character (held back until complete).

    Each push decodes only a window: the ids from the start of the previous
    delta on (context for spacing and merges), minus the text those context ids
    decode to, so a long output costs O(length), not O(length^2). ``emitted``
    is the whole text so far; ``tests/unit/test_tokenizer.py`` checks it equals
    decoding every id at once."""

    def __init__(self, tokenizer: TextTokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.emitted = ""
        self._prefix = 0  # window start: the previous delta's first id
        self._read = 0  # ids before this are in ``emitted``

    @property
    def unread(self) -> list[int]:
        """The ids whose text is not in ``emitted`` (an incomplete character, or
        ids that decode to nothing, e.g. special tokens, at the end)."""
        return self.ids[self._read :]

    def received(self) -> int | None:
        """How many leading ids ``emitted`` is exactly the text of: all of them, or
        where the ids end inside a character (a stream cut at its last id), those
        before the cut, found by decoding (the unread ids are a character's few
        bytes); None where no such prefix exists (a token that spans the cut)."""
        if not self.unread:
            return len(self.ids)
        for k in range(len(self.ids), self._read - 1, -1):
            if self.tokenizer.decode(self.ids[:k], self.skip) == self.emitted:
                return k
        return None

    def push(self, new_ids: Sequence[int], final: bool = False) -> str:
        """The text ``new_ids`` add; ``final`` (no ids follow): an incomplete
        character at the end is dropped, and the complete text before it sent."""
        self.ids.extend(new_ids)
        before = self.tokenizer.decode(self.ids[self._prefix : self._read], self.skip)
        text = self.tokenizer.decode(self.ids[self._prefix :], self.skip)
        if text.endswith("\ufffd") or len(text) <= len(before) or not text.startswith(before):
            if final and text.endswith("\ufffd"):
                text = text.rstrip("\ufffd")
                if len(text) > len(before) and text.startswith(before):
                    self.emitted += text[len(before) :]  # the ids stay unread: a character is cut
                    return text[len(before) :]
                return ""
            if text.endswith("\ufffd") or text == before:
                return ""  # an incomplete character (or nothing new): wait for more ids
            return self._resync()
        delta = text[len(before) :]
        self.emitted += delta
        self._prefix, self._read = self._read, len(self.ids)
        return delta

    def _resync(self) -> str:
        """The window's text does not extend its context's (a merge across the
        boundary): fall back to one full decode, exact by construction."""
        text = self.tokenizer.decode(self.ids, self.skip)
        if text.endswith("\ufffd"):
            return ""
        # NOTE: a decoder that rewrites earlier text when ids are added (none of ours)
        # would make ``text`` not extend ``emitted``; what was sent cannot be taken
        # back, so the rest continues from the same offset (as a full decode would)
        delta = text[len(self.emitted) :]
        self.emitted = text
        self._prefix, self._read = self._read, len(self.ids)
        return delta
