"""The sampling an OpenAI body asks for (``request_builder.Sampling``), with vLLM's
defaults: the request's value, else the model's ``generation_config.json``
(``TextTokenizer.generation_defaults``), else OpenAI's; ``top_k`` -1 is every token,
``seed`` -1 no seed, a repeated ``logit_bias`` id its last value; chat's
``max_completion_tokens`` before ``max_tokens`` and ``top_logprobs`` behind ``logprobs``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.router.openai_models import ChatCompletionRequest, _Common
from services.router.request_builder import Sampling


def sampling_of(body: _Common, gen: Mapping[str, float]) -> Sampling:
    """The sampling of ``body`` (module docstring); ``gen``: the model's defaults."""
    if isinstance(body, ChatCompletionRequest):
        max_tokens = body.max_completion_tokens or body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        max_tokens, logprobs = body.max_tokens, body.logprobs  # type: ignore[attr-defined]

    def value(name: str, default: float) -> Any:
        v = getattr(body, name)
        return v if v is not None else gen.get(name, default)

    return Sampling(
        max_tokens=max_tokens,
        temperature=value("temperature", 1.0),
        top_p=value("top_p", 1.0),
        top_k=max(int(value("top_k", 0)), 0),  # vLLM: -1 and 0 both mean every token
        seed=None if body.seed == -1 else body.seed,  # vLLM: -1 is no seed
        ignore_eos=body.ignore_eos,
        min_p=value("min_p", 0.0),
        presence_penalty=value("presence_penalty", 0.0),
        frequency_penalty=value("frequency_penalty", 0.0),
        repetition_penalty=value("repetition_penalty", 1.0),
        logit_bias=tuple({int(k): v for k, v in (body.logit_bias or {}).items()}.items()),  # a repeated id: the last
        min_tokens=body.min_tokens,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        bad_words=tuple(body.bad_words or ()),
        allowed_token_ids=tuple(body.allowed_token_ids) if body.allowed_token_ids is not None else None,
        logprobs=logprobs,
        structured=body.structured(),
    )
