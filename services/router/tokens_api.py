"""vLLM's token endpoints beside the OpenAI API: ``POST /tokenize`` (a prompt, or
chat messages through the template), ``POST /detokenize`` and ``GET /version``.
Keyed like ``/v1/`` (``openai_api.KEYED_PATHS``)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from hybridpd import __version__
from hybridpd.errors import InvalidRequestError, NotFoundError
from hybridpd.tokenizer import ChatMessage, ChatOptions
from services.router.openai_models import DetokenizeRequest, TokenizeRequest

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    """vLLM's ``/tokenize``: a prompt, or chat messages through the template, to ids."""
    st = request.app.state.hybridpd
    tok = st.orch.tokenizer
    if body.model and body.model != st.served_model:
        raise NotFoundError("model %r is not served here (serving %r)" % (body.model, st.served_model))
    if body.messages is not None:
        msgs = [ChatMessage(m.role, m.text) for m in body.messages]
        opts = ChatOptions(
            body.add_generation_prompt,
            body.continue_final_message,
            body.chat_template_kwargs or {},
            bool(body.add_special_tokens),
        )
        ids = tok.chat_prompt(msgs, opts).ids
    elif body.prompt is not None:
        ids = tok.encode(body.prompt, True if body.add_special_tokens is None else body.add_special_tokens)
    else:
        raise InvalidRequestError("tokenize needs a prompt or messages")
    strs = [tok.token_str(i) for i in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": st.orch.cfg.max_model_len, "tokens": ids, "token_strs": strs}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    """vLLM's ``/detokenize``: ids to text."""
    st = request.app.state.hybridpd
    if body.model and body.model != st.served_model:
        raise NotFoundError("model %r is not served here (serving %r)" % (body.model, st.served_model))
    vocab = st.orch.tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise InvalidRequestError("tokens must lie in [0, %d)" % vocab)
    return {"prompt": st.orch.tokenizer.decode(body.tokens, False)}  # special tokens kept, as vLLM's


@router.get("/version")
async def version() -> dict:
    return {"version": __version__}
