"""Request bodies of the OpenAI-compatible API (validated by pydantic): the request
surface of vLLM's OpenAI server, field for field.

Every field a body may carry is in exactly one of three sets, and
``tests/unit/test_request_fields.py`` fails if one is in none:

* honoured (``request_fields.HONOURED``): it changes what is served, through the one request
  builder (``request_builder.py``) and the output side; a field an engine cannot
  honour is refused there by its profile (``engine/profile.py``), e.g. structured
  outputs on the native engine;
* passed (``request_fields.PASSED``): it changes no output (``user``, ``metadata``, ...);
* refused (``request_fields.REFUSED``): a value other than its default is a 400 naming the field.

A field that is in none (not vLLM's, not OpenAI's, not ours) is a 400 naming it:
nothing is silently ignored. Extensions: ``cache_salt`` (tenant isolation),
``return_token_ids``, ``hybridpd_prefill_instance`` (pin a request to one prefill
instance), on completions ``hybridpd_checkpoints`` (extra checkpoint positions,
checked by ``validation.validate_request``), on chat ``hybridpd_answer_checkpoint``
(false: do not make this answer part of the cached prefix).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hybridpd.engine.sampling import StructuredOutput
from hybridpd.errors import InvalidRequestError
from services.router.request_fields import refused_fields

#: the most top logprobs (vLLM's default ``max_logprobs``)
MAX_LOGPROBS = 20


class _Strict(BaseModel):
    """Collects every field sent (``extra="allow"``) so that none passes unnoticed."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        if isinstance(data, dict):
            bad = refused_fields(data, set(cls.model_fields))
            if bad:
                raise ValueError("not supported: %s" % ", ".join(sorted(map(str, bad))))
        return data


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = None
    continuous_usage_stats: Literal[False] | None = None


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    model_config = ConfigDict(extra="forbid")

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = Field(None, max_length=65536)
    choice: list[str] | None = Field(None, min_length=1, max_length=256)
    grammar: str | None = Field(None, max_length=65536)
    json_object: bool | None = None
    whitespace_pattern: str | None = None

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        n = sum(
            x is not None and x is not False
            for x in (self.json_, self.regex, self.choice, self.grammar, self.json_object)
        )
        if n != 1:
            raise ValueError("exactly one of json, regex, choice, grammar, json_object must be set")
        return self


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(1 << 63), le=(1 << 64) - 1)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    #: prompts x n is bounded by the config's ``max_choices`` (``request_builder.check_choices``)
    n: int | None = Field(1, ge=1)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    request_id: str | None = Field(None, max_length=128)
    return_token_ids: bool | None = False
    return_tokens_as_token_ids: bool | None = None
    cache_salt: str | None = Field(None, max_length=256)
    hybridpd_prefill_instance: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for k in v or {}:
            try:
                int(k)
            except ValueError:
                raise ValueError("keys must be token ids, got %r" % k) from None
        return v

    @model_validator(mode="after")
    def _spaces(self) -> _Common:
        # vLLM: spaces_between_special_tokens acts only where special tokens are kept
        extra = self.model_extra or {}
        if not self.skip_special_tokens and extra.get("spaces_between_special_tokens") is False:
            raise ValueError(
                "spaces_between_special_tokens: false is not supported (special tokens decode as they are)"
            )
        return self

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def structured(self) -> StructuredOutput | None:
        """The grammar ``response_format`` or ``structured_outputs`` asks for (None: free text)."""
        rf, so = self.response_format, self.structured_outputs
        if rf is not None and rf.type != "text" and so is not None:
            raise InvalidRequestError("response_format: set it or structured_outputs, not both")
        if so is not None:
            schema = so.json_ if isinstance(so.json_, str) or so.json_ is None else json.dumps(so.json_)
            choice = tuple(so.choice) if so.choice is not None else None
            return StructuredOutput(schema, bool(so.json_object), so.regex, choice, so.grammar, so.whitespace_pattern)
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return StructuredOutput(json_object=True)
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise InvalidRequestError("response_format: json_schema needs its schema")
        return StructuredOutput(json=json.dumps(rf.json_schema.json_schema))

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def choices(self) -> int:
        return self.n or 1


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_special_tokens: bool = True
    hybridpd_checkpoints: list[int] | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list[str] | list[int] | list[list[int]]) -> str | list[str] | list[int] | list[list[int]]:
        if isinstance(v, str):
            if not v:
                raise ValueError("prompt must not be empty")
            return v
        if not v:
            raise ValueError("prompt list must not be empty")
        if isinstance(v[0], int):
            return v
        if any(not p for p in v):
            raise ValueError("no prompt of a batch may be empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The batch: one prompt per entry (a single prompt is a batch of one)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    """One message: text content, or a list of text parts (joined with newlines, as
    vLLM joins them for a template that takes strings). Images, audio and tool
    calls are refused by name."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=256)

    @property
    def text(self) -> str:
        c = self.content
        if c is None:
            return ""
        return c if isinstance(c, str) else "\n".join(p.text for p in c)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: FunctionDef

    def as_template(self) -> dict[str, Any]:
        """The tool as vLLM hands it to the chat template (``strict`` left out, unset fields null)."""
        f = self.function
        return {
            "type": self.type,
            "function": {"name": f.name, "description": f.description, "parameters": f.parameters},
        }


class ChatCompletionRequest(_Common):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    #: rendered into the prompt by the chat template; with ``tool_choice`` "none" only
    #: (this server parses no tool calls: "auto", "required" and a named tool are refused)
    tools: list[ToolDef] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    #: make this answer part of the cached prefix (default: the answer_checkpoints config)
    hybridpd_answer_checkpoint: bool | None = None

    @model_validator(mode="after")
    def _chat_rules(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("Cannot set both continue_final_message and add_generation_prompt to True.")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.tools == []:
            raise ValueError("tools must not be an empty array: give at least one tool or omit the field")
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else None)
        if choice not in (None, "none"):
            raise ValueError(
                "tool_choice %r is not supported: this server parses no tool calls (use tool_choice 'none')"
                % (choice if isinstance(choice, str) else "named")
            )
        return self


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize`` body: ``prompt``, or ``messages`` with the chat fields."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = Field(None, max_length=8 << 20)
    messages: list[ChatMessageIn] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: int


class ErrorResponse(BaseModel):
    """Body of every 4xx/5xx: ``{"error": {"message", "type", "code"}}``."""

    error: ErrorDetail
