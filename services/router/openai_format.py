"""OpenAI response bodies, as vLLM's server writes them: choices (text or chat
message, ``finish_reason``, ``stop_reason``, logprobs, echo), usage, SSE chunks.

One :class:`ResponseWriter` per request keeps each choice's state: whether its
first chunk went (the chat role, the echoed text), the text offset of its
completion logprobs, and for a non-streaming body its text, ids and logprobs.

Logprobs (vLLM 0.32's ``_create_completion_logprobs`` / ``_create_chat_logprobs``):
a token's entry is ``{sampled, top 1, ..., top k}`` in that order, a repeated id
once; completions list all of it per token (``top_logprobs`` of ``k + 1`` or
``k`` strings), chat its first ``top_logprobs`` entries. Token strings are
``tokenizer.decode([id])`` (special tokens kept), or ``token_id:<id>`` with
``return_tokens_as_token_ids``; a log-probability below -9999 is -9999.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from hybridpd.engine.base import TokenLogprobs
from hybridpd.tokenizer import TextTokenizer
from services.router.output import Event, Usage

Kind = Literal["chat", "completions"]
FLOOR = -9999.0


@dataclass(frozen=True, slots=True)
class LogprobOptions:
    """What the client asked of logprobs: none (``top`` None), or the sampled token's
    and ``top`` most likely (chat: ``top_logprobs``; completions: ``logprobs``)."""

    top: int | None = None
    as_token_ids: bool = False


@dataclass(slots=True)
class _ChoiceState:
    started: bool = False
    text_offset: int = 0
    text: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    completion: dict[str, list[Any]] = field(
        default_factory=lambda: {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    )
    last: Event | None = None


class ResponseWriter:
    """The JSON of one request's choices (module docstring)."""

    def __init__(
        self,
        kind: Kind,
        tok: TextTokenizer,
        oid: str,
        created: int,
        model: str,
        logprobs: LogprobOptions,
        return_token_ids: bool,
        echo: dict[int, str] | None = None,
        prompts: dict[int, tuple[int, ...]] | None = None,
        cache_details: bool = True,
    ) -> None:
        self.kind, self.tok, self.oid, self.created, self.model = kind, tok, oid, created, model
        #: whether usage carries the hybridpd_* details (``auth.sees_cache_details``)
        self.cache_details = cache_details
        self.lp = logprobs
        self.return_token_ids = return_token_ids
        #: choice -> the text echoed before it (vLLM: none when the ids are returned instead)
        self.echo: dict[int, str] = {}
        #: choice -> its prompt's ids (``return_token_ids``: completions per choice, chat once)
        self.prompts: dict[int, tuple[int, ...]] = {}
        self.prepare(echo or {}, prompts or {})
        self.state: dict[int, _ChoiceState] = {}

    def prepare(self, echo: dict[int, str], prompts: dict[int, tuple[int, ...]]) -> None:
        """What is known once the request is built, before its first event: each
        choice's echoed text and prompt ids."""
        self.echo = {} if self.return_token_ids and self.kind == "completions" else echo
        self.prompts = prompts

    # -- pieces -----------------------------------------------------------------------
    def _token(self, token_id: int) -> str:
        return "token_id:%d" % token_id if self.lp.as_token_ids else self.tok.token_text(token_id)

    @staticmethod
    def _entries(tok_id: int, lp: TokenLogprobs) -> list[tuple[int, float]]:
        """vLLM's per-token dict: the sampled token, then the top ones, each id once."""
        seen: dict[int, float] = {tok_id: lp.logprob}
        for t, v in lp.top:
            seen.setdefault(t, v)
        return list(seen.items())

    def _chat_logprobs(self, ids: tuple[int, ...], lps: tuple[TokenLogprobs, ...]) -> list[dict[str, Any]]:
        k = self.lp.top or 0
        out = []
        for tok_id, lp in zip(ids, lps, strict=True):
            token = self._token(tok_id)
            top = []
            for t, v in self._entries(tok_id, lp)[:k]:
                s = self._token(t)
                top.append({"token": s, "logprob": max(v, FLOOR), "bytes": list(s.encode("utf-8", "replace"))})
            out.append(
                {
                    "token": token,
                    "logprob": max(lp.logprob, FLOOR),
                    "bytes": list(token.encode("utf-8", "replace")),
                    "top_logprobs": top,
                }
            )
        return out

    def _completion_logprobs(
        self, st: _ChoiceState, ids: tuple[int, ...], lps: tuple[TokenLogprobs, ...]
    ) -> dict[str, list[Any]]:
        part: dict[str, list[Any]] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for tok_id, lp in zip(ids, lps, strict=True):
            token = self._token(tok_id)
            part["tokens"].append(token)
            part["token_logprobs"].append(max(lp.logprob, FLOOR))
            part["top_logprobs"].append({self._token(t): max(v, FLOOR) for t, v in self._entries(tok_id, lp)})
            part["text_offset"].append(st.text_offset)
            st.text_offset += len(token)
        return part

    def _state(self, index: int) -> _ChoiceState:
        st = self.state.get(index)
        if st is None:
            st = self.state[index] = _ChoiceState(text_offset=len(self.echo.get(index, "")))
        return st

    # -- streaming --------------------------------------------------------------------
    def chunk(self, index: int, ev: Event) -> dict[str, Any]:
        """The SSE data object of one event of choice ``index``."""
        st = self._state(index)
        text = ev.text
        first = not st.started
        if first:
            text = self.echo.get(index, "") + text
            st.started = True
        choice: dict[str, Any] = {"index": index, "finish_reason": ev.finish_reason, "logprobs": None}
        if ev.finished:
            choice["stop_reason"] = ev.stop_reason
        lps = ev.logprobs if self.lp.top is not None else None
        if self.kind == "chat":
            choice["delta"] = ({"role": "assistant"} if first else {}) | {"content": text}
            if lps is not None:
                choice["logprobs"] = {"content": self._chat_logprobs(ev.token_ids, lps)}
        else:
            choice["text"] = text
            if lps is not None:
                choice["logprobs"] = self._completion_logprobs(st, ev.token_ids, lps)
        out: dict[str, Any] = {"id": self.oid, "created": self.created, "model": self.model, "choices": [choice]}
        out["object"] = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        if self.return_token_ids:
            choice["token_ids"] = list(ev.token_ids)
            if first:  # vLLM: the prompt's ids with a choice's first chunk (chat: the response's first)
                self._prompt_ids(out, choice, index, once=index == min(self.prompts, default=index))
        return out

    def _prompt_ids(self, out: dict[str, Any], choice: dict[str, Any], index: int, once: bool) -> None:
        ids = self.prompts.get(index)
        if ids is None:
            return
        if self.kind == "chat":
            if once:
                out["prompt_token_ids"] = list(ids)
        else:
            choice["prompt_token_ids"] = list(ids)

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {
            "id": self.oid,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage,
        }

    # -- one body ---------------------------------------------------------------------
    def add(self, index: int, ev: Event) -> None:
        """Collect an event of choice ``index`` for :meth:`body`."""
        st = self._state(index)
        st.text.append(ev.text)
        st.ids.extend(ev.token_ids)
        if ev.logprobs is not None and self.lp.top is not None:
            if self.kind == "chat":
                st.logprobs.extend(self._chat_logprobs(ev.token_ids, ev.logprobs))
            else:
                for key, vals in self._completion_logprobs(st, ev.token_ids, ev.logprobs).items():
                    st.completion[key].extend(vals)
        if ev.finished:
            st.last = ev

    def body(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The whole response, every choice by index."""
        choices: list[dict[str, Any]] = []
        extra: dict[str, Any] = {}
        for index in sorted(self.state):
            st = self.state[index]
            last = st.last
            text = self.echo.get(index, "") + "".join(st.text)
            choice: dict[str, Any] = {
                "index": index,
                "finish_reason": last.finish_reason if last is not None else None,
                "stop_reason": last.stop_reason if last is not None else None,
                "logprobs": None,
            }
            if self.kind == "chat":
                choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
                if self.lp.top is not None:
                    choice["logprobs"] = {"content": st.logprobs}
            else:
                choice["text"] = text
                if self.lp.top is not None:
                    choice["logprobs"] = st.completion
            if self.return_token_ids:
                choice["token_ids"] = st.ids
                self._prompt_ids(extra, choice, index, once=not choices)
            choices.append(choice)
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {
            "id": self.oid,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
            **extra,
        }


def usage_json(usages: dict[int, Usage], n: int, details: bool = True) -> dict[str, Any]:
    """Usage of a request's choices (index -> its usage; ``n`` per prompt): each
    prompt's tokens once (its first choice's), every choice's completion tokens;
    with ``details``, the ``hybridpd_*`` details of the first choices, summed."""
    firsts = [u for i, u in sorted(usages.items()) if i % n == 0]
    prompt = sum(u.prompt_tokens for u in firsts)
    completion = sum(u.completion_tokens for u in usages.values())
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in firsts)},
    }
    if details and all(u.prefix_tokens is not None for u in firsts):
        merged: dict[str, int] = {}
        for u in firsts:
            for k, v in (u.prefix_tokens or {}).items():
                merged[k] = merged.get(k, 0) + v
        out["hybridpd_prefix_tokens"] = merged
        if all(u.promised_tokens is not None for u in firsts):
            out["hybridpd_promised_tokens"] = sum(u.promised_tokens or 0 for u in firsts)
    return out
