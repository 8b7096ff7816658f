"""Nothing a client sends is silently ignored (issue #49, item 3).

Every field of the request models is honoured (a named test shows its effect),
passed (it changes no output) or refused (a value other than its default is a
400 naming it); every field of vLLM 0.32's OpenAI server is one of ours; an
unknown field is refused by name."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from services.router.openai_models import ChatCompletionRequest, CompletionRequest
from services.router.request_fields import HONOURED, PASSED, REFUSED

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

#: vLLM 0.32's ``CompletionRequest`` and ``ChatCompletionRequest`` fields (read from
#: ``vllm.entrypoints.openai.*.protocol``): the surface a ``vllm serve`` user sends
VLLM_COMPLETION = """model prompt echo frequency_penalty logit_bias logprobs max_tokens n presence_penalty seed stop
stream stream_options suffix temperature top_p user use_beam_search top_k min_p repetition_penalty watermarking
length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens skip_special_tokens
spaces_between_special_tokens truncate_prompt_tokens truncation_side allowed_token_ids prompt_logprobs
logprob_token_ids bad_words prompt_embeds add_special_tokens response_format structured_outputs priority request_id
session_id return_tokens_as_token_ids return_token_ids routed_experts_prompt_start return_token_offsets mm_payload
return_mm_kwargs cache_salt kv_transfer_params ec_transfer_params vllm_xargs repetition_detection thinking_token_budget
stream_interval""".split()
VLLM_CHAT = """messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens max_completion_tokens n
presence_penalty response_format seed stop stream stream_options temperature top_p tools tool_choice reasoning_effort
thinking_token_budget include_reasoning parallel_tool_calls user use_beam_search top_k min_p repetition_penalty
watermarking length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens skip_special_tokens
spaces_between_special_tokens truncate_prompt_tokens truncation_side prompt_logprobs logprob_token_ids
allowed_token_ids bad_words echo add_generation_prompt continue_final_message add_special_tokens documents
chat_template chat_template_kwargs media_io_kwargs mm_processor_kwargs structured_outputs priority request_id
session_id return_tokens_as_token_ids return_token_ids routed_experts_prompt_start return_token_offsets
return_prompt_text mm_payload return_mm_kwargs cache_salt kv_transfer_params ec_transfer_params vllm_xargs
repetition_detection stream_interval""".split()

#: a value each refused field is refused at
REFUSED_VALUES: dict[str, Any] = {
    "suffix": "x",
    "use_beam_search": True,
    "watermarking": True,
    "length_penalty": 2.0,
    "prompt_logprobs": 1,
    "logprob_token_ids": [1],
    "prompt_embeds": "AAAA",
    "priority": 1,
    "routed_experts_prompt_start": 1,
    "return_token_offsets": True,
    "return_mm_kwargs": True,
    "return_prompt_text": True,
    "kv_transfer_params": {"do_remote_decode": True},
    "ec_transfer_params": {"x": 1},
    "vllm_xargs": {"x": 1},
    "repetition_detection": {"x": 1},
    "thinking_token_budget": 10,
    "stream_interval": 4,
    "reasoning_effort": "low",
    "documents": [{"text": "x"}],
    "chat_template": "{{ messages }}",
    "media_io_kwargs": {"image": {}},
    "mm_processor_kwargs": {"x": 1},
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "best_of": 2,
    "modalities": ["audio"],
    "audio": {"voice": "x"},
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
}

COMPLETION = {"model": "tiny", "prompt": "hi"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def _fields(model: type) -> set[str]:
    return set(model.model_fields)  # type: ignore[attr-defined]


def test_every_field_is_honoured_passed_or_refused() -> None:
    fields = _fields(CompletionRequest) | _fields(ChatCompletionRequest)
    unclassified = sorted(f for f in fields if f not in HONOURED and f not in PASSED and f not in REFUSED)
    assert not unclassified, "fields neither honoured nor passed nor refused: %s" % unclassified
    assert not (set(HONOURED) & set(REFUSED)) and not (set(HONOURED) & PASSED) and not (set(REFUSED) & PASSED)


def test_every_vllm_field_is_ours() -> None:
    known = set(HONOURED) | PASSED | set(REFUSED)
    assert not [f for f in VLLM_COMPLETION if f not in known]
    assert not [f for f in VLLM_CHAT if f not in known]


def test_each_honoured_field_names_a_test_that_exists() -> None:
    for field, where in HONOURED.items():
        path, _, name = where.partition("::")
        f = ROOT / path
        assert f.exists(), (field, where)
        if name:
            assert re.search(r"^(async )?def %s\(" % re.escape(name), f.read_text(), re.M), (field, where)


@pytest.mark.parametrize("field", sorted(REFUSED_VALUES))
def test_each_refused_field_is_a_400_naming_it(field: str) -> None:
    assert REFUSED[field](REFUSED_VALUES[field])
    for model, body in ((CompletionRequest, COMPLETION), (ChatCompletionRequest, CHAT)):
        with pytest.raises(ValidationError, match=field):
            model.model_validate({**body, field: REFUSED_VALUES[field]})


def test_every_refused_field_has_a_refused_value() -> None:
    assert set(REFUSED_VALUES) == set(REFUSED)


def test_defaults_of_refused_fields_pass() -> None:
    defaults = {"length_penalty": 1.0, "priority": 0, "use_beam_search": False}
    for model, body in ((CompletionRequest, COMPLETION), (ChatCompletionRequest, CHAT)):
        model.model_validate({**body, **defaults})


def test_unknown_and_other_endpoint_fields_are_refused_by_name() -> None:
    with pytest.raises(ValidationError, match="frobnicate"):
        CompletionRequest.model_validate({**COMPLETION, "frobnicate": 1})
    with pytest.raises(ValidationError, match="messages"):
        CompletionRequest.model_validate({**COMPLETION, "messages": CHAT["messages"]})
    with pytest.raises(ValidationError, match="continue_final_message"):
        CompletionRequest.model_validate({**COMPLETION, "continue_final_message": True})
    with pytest.raises(ValidationError, match="prompt"):
        ChatCompletionRequest.model_validate({**CHAT, "prompt": "x"})
    for passed in PASSED:
        CompletionRequest.model_validate({**COMPLETION, passed: "x"})


def test_chat_parts_and_their_limits() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    req = ChatCompletionRequest.model_validate({**CHAT, "messages": [{"role": "user", "content": parts}]})
    assert req.messages[0].text == "a\nb"
    with pytest.raises(ValidationError, match="image_url"):
        ChatCompletionRequest.model_validate(
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
        )
    with pytest.raises(ValidationError, match="tool_calls"):
        ChatCompletionRequest.model_validate({**CHAT, "messages": [{"role": "assistant", "tool_calls": []}]})
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    ChatCompletionRequest.model_validate({**CHAT, "tools": tools, "tool_choice": "none"})
    for choice in ({}, {"tool_choice": "auto"}, {"tool_choice": "required"}):
        with pytest.raises(ValidationError, match="tool_choice"):
            ChatCompletionRequest.model_validate({**CHAT, "tools": tools, **choice})
    with pytest.raises(ValidationError, match="tools"):
        ChatCompletionRequest.model_validate({**CHAT, "tools": []})
    with pytest.raises(ValidationError, match="Cannot set both"):
        ChatCompletionRequest.model_validate({**CHAT, "continue_final_message": True})
