"""Request bodies of the OpenAI-compatible API (validated by pydantic).

Unknown fields are ignored, as OpenAI clients send many; fields we cannot
honour with a value that matters (n > 1, logprobs, echo, best_of) are a 400.
Extensions: ``cache_salt`` (tenant isolation), ``return_token_ids`` (token
ids in each choice), ``ignore_eos``, ``hybridpd_prefill_instance`` (pin a
request to one prefill instance, for tests and debugging); on completions
``hybridpd_checkpoints`` (extra checkpoint positions, token counts; checked
by ``validation.validate_request``); on chat ``hybridpd_answer_checkpoint``
(false: do not make this answer part of the cached prefix).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP = 4


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=-(1 << 63), le=(1 << 64) - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = Field(1, ge=1)
    logprobs: bool | int | None = None
    cache_salt: str | None = Field(None, max_length=256)
    return_token_ids: bool = False
    ignore_eos: bool = False
    user: str | None = None
    hybridpd_prefill_instance: str | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | int | None) -> bool | int | None:
        if v:
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError("at most %d stop sequences" % MAX_STOP)
        return v

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Common):
    prompt: str | list[int]
    echo: bool = False
    best_of: int | None = None
    hybridpd_checkpoints: list[int] | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list[int]) -> str | list[int]:
        if isinstance(v, list) and not v:
            raise ValueError("prompt token list must not be empty")
        if isinstance(v, str) and not v:
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(_Common):
    messages: list[ChatMessageIn] = Field(min_length=1)
    #: make this answer part of the cached prefix (default: the answer_checkpoints config)
    hybridpd_answer_checkpoint: bool | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: int


class ErrorResponse(BaseModel):
    """Body of every 4xx/5xx: ``{"error": {"message", "type", "code"}}``."""

    error: ErrorDetail
