"""Which request fields the OpenAI-compatible API honours, passes or refuses
(``openai_models.py`` enforces it; ``tests/unit/test_request_fields.py`` checks
every field of the request models is in exactly one set).

* :data:`HONOURED`: it changes what is served; each names the test showing that;
* :data:`PASSED`: it changes no output;
* :data:`REFUSED`: a value other than its default is a 400 naming the field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _set(v: Any) -> bool:
    return v is not None and v is not False


#: field -> whether a value is refused (a 400 naming the field)
REFUSED: dict[str, Callable[[Any], bool]] = {
    "suffix": _set,
    "use_beam_search": _set,
    "watermarking": _set,
    "length_penalty": lambda v: v != 1.0,
    "prompt_logprobs": _set,
    "logprob_token_ids": _set,
    "prompt_embeds": _set,
    "priority": lambda v: v != 0,
    "routed_experts_prompt_start": lambda v: v != 0,
    "return_token_offsets": _set,
    "return_mm_kwargs": _set,
    "return_prompt_text": _set,
    "kv_transfer_params": _set,
    "ec_transfer_params": _set,
    "vllm_xargs": _set,
    "repetition_detection": _set,
    "thinking_token_budget": _set,
    "stream_interval": lambda v: v is not None and v != 1,
    "reasoning_effort": _set,
    "documents": _set,
    "chat_template": _set,
    "media_io_kwargs": _set,
    "mm_processor_kwargs": _set,
    "functions": lambda v: bool(v),
    "function_call": lambda v: v not in (None, "none"),
    "best_of": lambda v: v not in (None, 1),
    "modalities": lambda v: v not in (None, ["text"]),
    "audio": _set,
    "prediction": _set,
    "web_search_options": _set,
}

#: fields that change no output: accepted as sent
PASSED: frozenset[str] = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "session_id",
        "parallel_tool_calls",
        "include_reasoning",
        "spaces_between_special_tokens",
        "mm_payload",
        "verbosity",
    }
)

#: fields that change what is served, each with the test that shows its effect
HONOURED: dict[str, str] = {
    "model": "tests/e2e/test_request_surface.py::test_another_model_is_404",
    "prompt": "tests/e2e/test_serving.py",
    "messages": "tests/e2e/test_serving.py",
    "max_tokens": "tests/e2e/test_request_surface.py::test_every_honoured_field_changes_the_output",
    "max_completion_tokens": "tests/e2e/test_request_surface.py::test_every_honoured_field_changes_the_output",
    "temperature": "tests/e2e/test_request_surface.py::test_every_honoured_field_changes_the_output",
    "top_p": "tests/e2e/test_request_surface.py::test_every_honoured_field_changes_the_output",
    "top_k": "tests/e2e/test_request_surface.py::test_every_honoured_field_changes_the_output",
    "min_p": "tests/e2e/test_request_surface.py::test_every_honoured_field_changes_the_output",
    "seed": "tests/e2e/test_request_surface.py::test_every_honoured_field_changes_the_output",
    "stop": "tests/e2e/test_request_surface.py::test_every_honoured_field_changes_the_output",
    "stream": "tests/e2e/test_serving.py",
    "stream_options": "tests/e2e/test_request_surface.py::test_usage_in_a_stream",
    "n": "tests/e2e/test_request_surface.py::test_n_choices_share_the_prompt",
    "logprobs": "tests/e2e/test_request_surface.py::test_logprobs_on_both_endpoints",
    "top_logprobs": "tests/e2e/test_request_surface.py::test_logprobs_on_both_endpoints",
    "echo": "tests/e2e/test_request_surface.py::test_echo",
    "presence_penalty": "tests/e2e/test_request_surface.py::test_every_honoured_field_changes_the_output",
    "frequency_penalty": "tests/e2e/test_request_surface.py::test_every_honoured_field_changes_the_output",
    "repetition_penalty": "tests/e2e/test_request_surface.py::test_every_honoured_field_changes_the_output",
    "logit_bias": "tests/e2e/test_request_surface.py::test_every_honoured_field_changes_the_output",
    "min_tokens": "tests/e2e/test_request_surface.py::test_every_honoured_field_changes_the_output",
    "stop_token_ids": "tests/e2e/test_request_surface.py::test_every_honoured_field_changes_the_output",
    "bad_words": "tests/e2e/test_request_surface.py::test_every_honoured_field_changes_the_output",
    "allowed_token_ids": "tests/e2e/test_request_surface.py::test_every_honoured_field_changes_the_output",
    "ignore_eos": "tests/e2e/test_request_surface.py::test_every_honoured_field_changes_the_output",
    "include_stop_str_in_output": "tests/e2e/test_request_surface.py::test_every_honoured_field_changes_the_output",
    "skip_special_tokens": "tests/unit/test_request_builder.py::test_skip_special_tokens_keeps_them_in_the_text",
    "truncate_prompt_tokens": "tests/e2e/test_request_surface.py::test_every_honoured_field_changes_the_output",
    "truncation_side": "tests/unit/test_request_builder.py::test_truncation_keeps_the_side_asked_for",
    "add_special_tokens": "tests/unit/test_request_builder.py::test_add_special_tokens_reaches_the_tokenizer",
    "response_format": "tests/vllm/test_request_surface.py",
    "structured_outputs": "tests/vllm/test_request_surface.py",
    "request_id": "tests/e2e/test_request_surface.py::test_request_id_field_is_echoed_not_used",
    "return_token_ids": "tests/e2e/test_serving.py",
    "return_tokens_as_token_ids": "tests/e2e/test_request_surface.py::test_logprobs_on_both_endpoints",
    "cache_salt": "tests/e2e/test_auth.py",
    "add_generation_prompt": "tests/e2e/test_request_surface.py::test_chat_rendering_fields",
    "continue_final_message": "tests/e2e/test_request_surface.py::test_chat_rendering_fields",
    "chat_template_kwargs": "tests/unit/test_request_builder.py::test_chat_template_kwargs_reach_the_template",
    "tools": "tests/unit/test_request_builder.py::test_tools_reach_the_template_with_tool_choice_none",
    "tool_choice": "tests/e2e/test_request_surface.py::test_what_is_not_honoured_is_a_400_naming_it",
    "hybridpd_prefill_instance": "tests/e2e/test_serving.py",
    "hybridpd_checkpoints": "tests/e2e/test_branch_aware.py",
    "hybridpd_answer_checkpoint": "tests/e2e/test_answers.py",
}


def refused_fields(data: dict[str, Any], fields: frozenset[str] | set[str]) -> list[str]:
    """The fields of a body ``data`` for a model of ``fields`` that are refused: set to a
    refused value, or neither a field of that model nor a passed one (unknown, or the
    other endpoint's)."""
    return [
        str(k)
        for k, v in data.items()
        if (k in REFUSED and REFUSED[k](v)) or (k not in fields and k not in PASSED and k not in REFUSED)
    ]
