"""vLLM's token endpoints beside the OpenAI API: ``POST /tokenize`` (a prompt, or
chat messages through the template), ``POST /detokenize`` and ``GET /version``.
Keyed like ``/v1/`` (``http_gate.KEYED_PATHS``). Tokenizing and detokenizing are
admitted as a request is (one in-flight slot: 429 past the limit), within the
request builder's bounds, and run in the tokenizer pool, off the event loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request

from hybridpd import __version__
from hybridpd.errors import InvalidRequestError, NotFoundError
from hybridpd.tokenizer import ChatMessage, ChatOptions, TextTokenizer
from services.router.openai_models import DetokenizeRequest, TokenizeRequest
from services.router.orchestrator import Orchestrator
from services.router.request_builder import MAX_NAME_CHARS, ApiRequest, Sampling, check_bounds

router = APIRouter()


async def _admitted(orch: Orchestrator, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in the tokenizer pool, holding one in-flight slot meanwhile."""
    ticket = orch.admission.enter(1)
    try:
        return await orch.off_loop(fn, *args)
    finally:
        orch.admission.release(ticket)


def _check_model(model: str | None, served: str) -> None:
    if model and model != served:
        raise NotFoundError("model %r is not served here (serving %r)" % (model[:MAX_NAME_CHARS], served))


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    """vLLM's ``/tokenize``: a prompt, or chat messages through the template, to ids."""
    st = request.app.state.hybridpd
    orch: Orchestrator = st.orch
    _check_model(body.model, st.served_model)
    if body.messages is not None:
        msgs = tuple(ChatMessage(m.role, m.text) for m in body.messages)
        check_bounds(ApiRequest("tokenize", st.served_model, Sampling(), messages=msgs), orch.cfg)
        opts = ChatOptions(
            body.add_generation_prompt,
            body.continue_final_message,
            body.chat_template_kwargs or {},
            bool(body.add_special_tokens),
        )
        ids, strs = await _admitted(orch, _chat_ids, orch.tokenizer, msgs, opts, bool(body.return_token_strs))
    elif body.prompt is not None:
        check_bounds(ApiRequest("tokenize", st.served_model, Sampling(), text=body.prompt), orch.cfg)
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids, strs = await _admitted(orch, _text_ids, orch.tokenizer, body.prompt, special, bool(body.return_token_strs))
    else:
        raise InvalidRequestError("tokenize needs a prompt or messages")
    return {"count": len(ids), "max_model_len": orch.cfg.max_model_len, "tokens": ids, "token_strs": strs}


def _chat_ids(
    tok: TextTokenizer, msgs: tuple[ChatMessage, ...], opts: ChatOptions, strs: bool
) -> tuple[list[int], list[str] | None]:
    ids = tok.chat_prompt(list(msgs), opts).ids
    return ids, [tok.token_str(i) for i in ids] if strs else None


def _text_ids(tok: TextTokenizer, text: str, special: bool, strs: bool) -> tuple[list[int], list[str] | None]:
    ids = tok.encode(text, special)
    return ids, [tok.token_str(i) for i in ids] if strs else None


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    """vLLM's ``/detokenize``: ids to text."""
    st = request.app.state.hybridpd
    orch: Orchestrator = st.orch
    _check_model(body.model, st.served_model)
    return {"prompt": await _admitted(orch, _text, orch.tokenizer, body.tokens)}


def _text(tok: TextTokenizer, ids: list[int]) -> str:
    if any(not 0 <= t < tok.vocab_size for t in ids):
        raise InvalidRequestError("tokens must lie in [0, %d)" % tok.vocab_size)
    return tok.decode(ids, False)  # special tokens kept, as vLLM's


@router.get("/version")
async def version() -> dict:
    return {"version": __version__}
