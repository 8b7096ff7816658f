"""One request builder for both APIs: what a client asked (HTTP or gRPC,
completion or chat) -> the :class:`EngineRequest` and, for chat, its answer plan.

The APIs only parse their wire format into an :class:`ApiRequest`; everything
that decides what is served lives here, so HTTP and gRPC are the same product:

* the served model (else NotFoundError), the prompt (text, token ids or chat
  messages; empty is refused), lengths of the client's ``request_id`` and
  ``cache_salt``; the request's id is the server's (:func:`new_request_id`);
* chat: the template with recalled answers (``answer_checkpoints``: a
  previous answer's text stands for the ids the model generated, so the next
  turn's prompt extends what is cached), the message-boundary checkpoints
  (``checkpoint_policy: branch-aware``) merged with the client's positions
  (``checkpoints.merge_requested``: ascending, at most 8, boundaries first; on
  vLLM, where each costs an engine step, handed to the dispatcher instead, which
  stages those far enough past the hit: ``Dispatcher.with_junction``), and
  the :class:`AnswerPlan` that makes this answer reusable at its end;
* chat rendering: ``add_generation_prompt``, ``continue_final_message``,
  ``chat_template_kwargs`` (``tokenizer.ChatOptions``); ``truncate_prompt_tokens``
  keeps the prompt's last (``truncation_side: right``: first) tokens;
* sampling: ``max_tokens`` as vLLM's server sets it: what was asked (default 16 on
  completions; on chat the model's ``generation_config`` or what the context leaves),
  clamped to what the context leaves; the tokenizer's end-of-turn ids stop unless
  ``ignore_eos``, the client's ``stop_token_ids`` always; ``bad_words`` become
  token id sequences as vLLM makes them; every feature the request needs is
  checked against the engine's profile (``engine/profile.py``: a 400 naming the
  field it cannot honour); the tenant's cache salt.

* bounds, checked before anything is tokenized (:func:`check_bounds`; the
  config's ``max_*`` fields): stop strings by count and length, the prompt's
  characters (a chat's: all its messages), the number of messages, bad words
  and biased tokens; :func:`check_choices`: prompts x ``n``, before admission.

``build`` tokenizes and renders: it runs in the orchestrator's tokenizer pool,
after admission (``choices.run_request``), never on the event loop. Ranges
(temperature, checkpoint positions, context length) are checked once built
(``hybridpd/validation.py``), as for every request.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from functools import partial

from hybridpd.auth import ApiKeys
from hybridpd.checkpoints import merge_requested
from hybridpd.config import HybridPDConfig
from hybridpd.engine.base import EngineRequest, RequestId, SamplingParams, StructuredOutput
from hybridpd.engine.profile import profile_of
from hybridpd.errors import InvalidRequestError, NotFoundError
from hybridpd.tokenizer import ChatMessage, ChatOptions, TextTokenizer
from hybridpd.validation import MAX_BAD_WORDS, MAX_BIASED_TOKENS, check_features, validate_checkpoints
from services.router.answers import AnswerPlan
from services.router.orchestrator import Orchestrator
from services.router.output import OutputOptions

DEFAULT_MAX_TOKENS = 16
#: chat: what the context leaves (vLLM's default)
DEFAULT_CHAT_MAX_TOKENS = 1 << 30
MAX_REQUEST_ID_CHARS = 128
MAX_CACHE_SALT_CHARS = 256
#: what of a client's name (of a model, say) an error message repeats
MAX_NAME_CHARS = 100


@dataclass(frozen=True, slots=True)
class Sampling:
    """What the client asked for; ``max_tokens`` None: the default."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    #: (token id, bias) pairs
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    #: the client's own stop ids (the tokenizer's end-of-turn ids are added unless ``ignore_eos``)
    stop_token_ids: tuple[int, ...] = ()
    #: words never generated (tokenized here as vLLM does: ``bad_word_ids``)
    bad_words: tuple[str, ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    logprobs: int | None = None
    structured: StructuredOutput | None = None


def new_request_id() -> str:
    """The id the server gives a request: what keys its work on every actor (a
    client's own id is only echoed back and logged: ``ApiRequest.client_id``)."""
    return uuid.uuid4().hex


def loggable(client_text: str) -> str:
    """A client's string as a log line may carry it: cut to ``MAX_REQUEST_ID_CHARS``
    and quoted with every newline and control character escaped (``repr``)."""
    return repr(client_text[:MAX_REQUEST_ID_CHARS])


@dataclass(frozen=True, slots=True)
class ApiRequest:
    """A parsed request of either API. Exactly one of ``text``, ``token_ids``,
    ``messages`` is set (chat: ``messages``)."""

    #: the server's id (:func:`new_request_id`): its engine requests are this id (a choice's
    #: ``<id>-<index>``), whatever the client sent
    request_id: str
    model: str
    sampling: Sampling
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None
    cache_salt: str | None = None
    #: client-named checkpoint positions (token counts)
    checkpoints: tuple[int, ...] = ()
    #: chat: make this answer reusable (None: the config's ``answer_checkpoints``)
    answer_checkpoint: bool | None = None
    #: the API key's tenant (its cache salt isolates the tenant's cache)
    tenant: str | None = None
    #: how chat messages render (chat only)
    chat: ChatOptions = field(default_factory=ChatOptions)
    #: text prompts: the tokenizer's special tokens around the text (vLLM's completions default)
    add_special_tokens: bool = False
    #: keep only this many prompt tokens (-1: the context), from ``truncation_side``
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "left"
    #: how its tokens become text: stop strings and the rest (the same for every choice)
    output: OutputOptions = field(default_factory=OutputOptions)
    #: echo the prompt before the answer (``Built.echo``)
    echo: bool = False
    #: the client's own id (``X-Request-Id``, the body's or gRPC's ``request_id``): echoed back
    #: and logged (:func:`loggable`), never used as an id of ours
    client_id: str | None = None


@dataclass(frozen=True, slots=True)
class Built:
    request: EngineRequest
    #: chat only: what the end of the request needs to make the answer reusable
    answer: AnswerPlan | None = None
    #: chat on vLLM under branch-aware: the message boundaries, not merged into the request's
    #: checkpoints (the dispatcher stages those worth an engine step once it knows the hit)
    boundaries: tuple[int, ...] = ()
    #: the text echoed before the answer (``ApiRequest.echo``; vLLM's rule): a text prompt
    #: as sent, token ids decoded with their special tokens, chat's last message when it
    #: has the answer's role; None: nothing
    echo: str | None = None


def check_choices(prompts: int, n: int, cfg: HybridPDConfig) -> None:
    """InvalidRequestError past ``max_choices`` (prompts x ``n``), or past what the router
    admits at once (``max_inflight_requests``: each choice holds a slot)."""
    limit = min(cfg.max_choices, cfg.max_inflight_requests)
    if prompts * n > limit:
        raise InvalidRequestError("n: at most %d choices per request (prompts x n), got %d" % (limit, prompts * n))


def check_bounds(api: ApiRequest, cfg: HybridPDConfig) -> None:
    """The request's sizes, before anything of it is tokenized (module docstring);
    InvalidRequestError naming the field past its bound."""
    if api.client_id is not None and len(api.client_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError("request_id longer than %d characters" % MAX_REQUEST_ID_CHARS)
    if api.cache_salt is not None and len(api.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequestError("cache_salt longer than %d characters" % MAX_CACHE_SALT_CHARS)
    stop = api.output.stop
    if len(stop) > cfg.max_stop_strings:
        raise InvalidRequestError("stop: at most %d stop strings, got %d" % (cfg.max_stop_strings, len(stop)))
    longest = max(map(len, stop), default=0)
    if longest > cfg.max_stop_chars:
        raise InvalidRequestError("stop: at most %d characters a stop string, got %d" % (cfg.max_stop_chars, longest))
    if api.messages is not None:
        if len(api.messages) > cfg.max_messages:
            raise InvalidRequestError("messages: at most %d, got %d" % (cfg.max_messages, len(api.messages)))
        chars = sum(len(m.content) + len(m.name or "") for m in api.messages)
        if chars > cfg.max_prompt_chars:
            raise InvalidRequestError("messages: at most %d characters in all, got %d" % (cfg.max_prompt_chars, chars))
    if api.text is not None and len(api.text) > cfg.max_prompt_chars:
        raise InvalidRequestError("prompt: at most %d characters, got %d" % (cfg.max_prompt_chars, len(api.text)))
    s = api.sampling
    if len(s.bad_words) > MAX_BAD_WORDS:
        raise InvalidRequestError("bad_words: at most %d words, got %d" % (MAX_BAD_WORDS, len(s.bad_words)))
    if len(s.logit_bias) > MAX_BIASED_TOKENS:
        raise InvalidRequestError("logit_bias: at most %d tokens, got %d" % (MAX_BIASED_TOKENS, len(s.logit_bias)))


def build(api: ApiRequest, orch: Orchestrator, served_model: str) -> Built:
    """The engine request (and chat plan) for ``api``; raises NotFoundError
    (another model) or InvalidRequestError (no prompt, past a bound). Tokenizes:
    call it in the tokenizer pool (``Orchestrator.off_loop``)."""
    if api.model and api.model != served_model:
        raise NotFoundError("model %r is not served here (serving %r)" % (api.model[:MAX_NAME_CHARS], served_model))
    cfg, tok = orch.cfg, orch.tokenizer
    check_bounds(api, cfg)
    profile = profile_of(cfg)
    salt = ApiKeys.salt(api.tenant, api.cache_salt)
    checkpoints = list(api.checkpoints)
    boundaries: tuple[int, ...] = ()
    plan: AnswerPlan | None = None
    if api.messages is not None:
        if not api.messages:
            raise InvalidRequestError("chat needs at least one message")
        recall = partial(orch.answers.recall, salt) if cfg.answer_checkpoints else None
        chat = tok.chat_prompt(list(api.messages), api.chat, recall=recall)
        tokens = chat.ids
        # branch-aware: checkpoint where the system prompt's shared part ends and where the last
        # user turn starts, so the first conversation already leaves them reusable
        if cfg.checkpoint_policy == "branch-aware":
            validate_checkpoints(tuple(checkpoints), len(tokens))  # the client's own list, as it sent it
            if profile.staged:  # each costs an engine step: the dispatcher stages those worth one
                boundaries = chat.boundaries
            else:
                checkpoints = list(merge_requested(checkpoints, chat.boundaries, len(tokens)))
        if chat.answer_span is not None:
            a0, a1 = chat.answer_span
            answer = next(m.content for m in reversed(api.messages) if m.role == "assistant")
            same = tok.encode(answer) == chat.ids[a0:a1]
            orch.metrics.answer_retokenized.labels("same" if same else "differs").inc()
        keep = api.answer_checkpoint if api.answer_checkpoint is not None else cfg.answer_checkpoints
        if keep:
            plan = AnswerPlan(salt, chat.text, chat.answer_span)
        default_max = int(tok.generation_defaults.get("max_tokens", DEFAULT_CHAT_MAX_TOKENS))
    elif api.token_ids is not None:
        tokens, default_max = list(api.token_ids), DEFAULT_MAX_TOKENS
    elif api.text is not None:
        tokens, default_max = tok.encode(api.text, api.add_special_tokens), DEFAULT_MAX_TOKENS
    else:
        raise InvalidRequestError("one of a prompt (text or token ids) or chat messages is required")
    if not tokens:
        raise InvalidRequestError("prompt tokenizes to nothing")
    untruncated = len(tokens)
    tokens = _truncated(tokens, api, cfg.max_model_len)
    if len(tokens) != untruncated:
        checkpoints, boundaries, plan = [], (), None  # positions of the untruncated prompt mean nothing
    s = api.sampling
    left = cfg.max_model_len - len(tokens)
    if left < 1:
        raise InvalidRequestError(
            "prompt (%d tokens) leaves no room in the model's context of %d tokens" % (len(tokens), cfg.max_model_len)
        )
    # vLLM's rule: what was asked (or the default), clamped to what the context leaves
    max_tokens = min(s.max_tokens if s.max_tokens is not None else default_max, left)
    sp = sampling_params(s, max_tokens, tok, profile.tokenizer_stop_ids)
    check_features(sp, profile)
    # hashed here, once per prompt (its n choices share the chain): it travels with the request
    chain = orch.dispatch.hasher.chain(tokens, cache_salt=salt) if cfg.enable_prefix_caching else []
    req = EngineRequest(
        RequestId(api.request_id), tuple(tokens), sp, salt, tuple(checkpoints), block_hashes=tuple(chain)
    )
    return Built(req, plan, boundaries, _echo(api, tok) if api.echo else None)


def _echo(api: ApiRequest, tok: TextTokenizer) -> str | None:
    """What vLLM echoes before the answer: the prompt (token ids decoded with their
    special tokens); on chat the last message, when it has the answer's role
    (vLLM's ``get_chat_request_role``)."""
    if api.messages:
        last = api.messages[-1]
        role = "assistant" if api.chat.add_generation_prompt else last.role
        return last.content if last.role == role else None
    if api.text is not None:
        return api.text
    return tok.decode(api.token_ids or (), False)


def sampling_params(s: Sampling, max_tokens: int, tok: TextTokenizer, end_of_turn: bool = True) -> SamplingParams:
    """The engine's sampling parameters for what the client asked; ``end_of_turn``: the
    tokenizer's end-of-turn ids stop it too (unless ``ignore_eos``; the engine profile's
    ``tokenizer_stop_ids``: vLLM stops where ``vllm serve`` does instead)."""
    eot = tok.stop_token_ids if end_of_turn and not s.ignore_eos else ()
    stops = tuple(dict.fromkeys((*s.stop_token_ids, *eot)))
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=s.seed,
        stop_token_ids=stops,  # the end-of-turn ids are EOS too
        ignore_eos=s.ignore_eos,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        logit_bias=tuple(sorted(s.logit_bias)),
        min_tokens=s.min_tokens,
        bad_words=bad_word_ids(s.bad_words, tok),
        logprobs=s.logprobs,
        structured=s.structured,
        min_p=s.min_p,
        allowed_token_ids=tuple(sorted(set(s.allowed_token_ids))) if s.allowed_token_ids is not None else None,
    )


def bad_word_ids(words: tuple[str, ...], tok: TextTokenizer) -> tuple[tuple[int, ...], ...]:
    """Token id sequences of ``bad_words``, as vLLM's ``SamplingParams.update_from_tokenizer``
    makes them: each word as it stands (leading spaces stripped), and with one leading
    space where that tokenizes to a different first token of the same length."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tok.encode(word.lstrip()))
        if not plain:
            raise InvalidRequestError("bad_words: %r tokenizes to nothing" % word)
        out.append(plain)
        spaced = tuple(tok.encode(" " + word.lstrip()))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return tuple(out)


def _truncated(tokens: list[int], api: ApiRequest, max_model_len: int) -> list[int]:
    """The prompt ``truncate_prompt_tokens`` keeps (vLLM's rule: -1 is the context)."""
    k = api.truncate_prompt_tokens
    if k is None or k >= len(tokens):
        return tokens
    if k == -1:
        k = max_model_len
        if k >= len(tokens):
            return tokens
    if k < 1:
        raise InvalidRequestError("truncate_prompt_tokens must be -1 or >= 1")
    return tokens[-k:] if api.truncation_side == "left" else tokens[:k]
