"""Request validation: the one place its rules and messages live.

The router calls it before routing (both APIs: HTTP and gRPC map the
InvalidRequestError to 400 / INVALID_ARGUMENT); the native engine calls it
again on ``add_request`` and ``add_handoff`` so an engine driven directly
(tests, benchmarks) refuses the same requests with the same messages.
"""

from __future__ import annotations

import math

from hybridpd.checkpoints import MAX_REQUESTED_CHECKPOINTS
from hybridpd.engine.base import EngineRequest, SamplingParams
from hybridpd.engine.profile import EngineProfile, Feature
from hybridpd.errors import InvalidRequestError

#: torch.Generator.manual_seed accepts exactly this range.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
#: a temperature below this is greedy (vLLM's ``_SAMPLING_EPS``)
GREEDY_EPS = 1e-5
#: vLLM's default ``max_logprobs``: the most top logprobs a request may ask for
MAX_LOGPROBS = 20
#: OpenAI's bounds: |presence|, |frequency| penalty <= 2, |logit bias| <= 100, 300 biased tokens
MAX_PENALTY, MAX_BIAS, MAX_BIASED_TOKENS = 2.0, 100.0, 300
#: bad words per request, and token ids per bad word
MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS = 64, 64


def validate_request(req: EngineRequest, vocab_size: int, max_model_len: int) -> None:
    """Raise InvalidRequestError (with a message a client can act on) unless
    ``req`` is servable by a model of ``vocab_size`` and context ``max_model_len``."""
    p = req.prompt_token_ids
    if not p:
        raise InvalidRequestError("prompt must not be empty")
    if min(p) < 0 or max(p) >= vocab_size:
        raise InvalidRequestError("token ids must lie in [0, %d)" % vocab_size)
    sp = req.sampling
    if sp.max_tokens < 1:
        raise InvalidRequestError("max_tokens must be >= 1")
    if not (math.isfinite(sp.temperature) and 0.0 <= sp.temperature <= 2.0):
        raise InvalidRequestError("temperature must be a number in [0, 2]")
    if not (math.isfinite(sp.top_p) and 0.0 < sp.top_p <= 1.0):
        raise InvalidRequestError("top_p must be a number in (0, 1]")
    if sp.top_k < 0:
        raise InvalidRequestError("top_k must be >= 0")
    if sp.seed is not None and not (SEED_MIN <= sp.seed <= SEED_MAX):
        raise InvalidRequestError("seed must lie in [%d, %d]" % (SEED_MIN, SEED_MAX))
    validate_processors(sp, vocab_size)
    validate_checkpoints(req.checkpoints, len(p))
    if len(p) + sp.max_tokens > max_model_len:
        raise InvalidRequestError(
            "prompt (%d tokens) + max_tokens (%d) exceeds the model's context of %d tokens"
            % (len(p), sp.max_tokens, max_model_len)
        )


def validate_checkpoints(positions: tuple[int, ...], num_prompt: int) -> None:
    """Extra checkpoint positions (``hybridpd_checkpoints``): at most
    ``MAX_REQUESTED_CHECKPOINTS``, strictly ascending, each inside the prompt.
    Which of them can hold a checkpoint is the engine's business
    (``checkpoints.requested_checkpoints``); a valid list never fails a request."""
    if len(positions) > MAX_REQUESTED_CHECKPOINTS:
        raise InvalidRequestError(
            "hybridpd_checkpoints: at most %d positions, got %d" % (MAX_REQUESTED_CHECKPOINTS, len(positions))
        )
    for i, pos in enumerate(positions):
        if isinstance(pos, bool) or not isinstance(pos, int):
            raise InvalidRequestError("hybridpd_checkpoints: positions must be integers, got %r" % (pos,))
        if not 0 < pos < num_prompt:
            raise InvalidRequestError(
                "hybridpd_checkpoints: position %d is not inside the prompt (0 < position < %d)" % (pos, num_prompt)
            )
        if i and pos <= positions[i - 1]:
            raise InvalidRequestError(
                "hybridpd_checkpoints must be strictly ascending: %d follows %d" % (pos, positions[i - 1])
            )


def validate_processors(sp: SamplingParams, vocab_size: int) -> None:
    """The logits processors' and logprobs' fields: OpenAI's and vLLM's ranges, token ids in the vocabulary."""
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(sp, name)
        if not (math.isfinite(v) and -MAX_PENALTY <= v <= MAX_PENALTY):
            raise InvalidRequestError("%s must be a number in [-2, 2], got %r" % (name, v))
    if not (math.isfinite(sp.repetition_penalty) and 0.0 < sp.repetition_penalty <= 2.0):
        raise InvalidRequestError("repetition_penalty must be a number in (0, 2], got %r" % sp.repetition_penalty)
    if len(sp.logit_bias) > MAX_BIASED_TOKENS:
        raise InvalidRequestError("logit_bias: at most %d tokens, got %d" % (MAX_BIASED_TOKENS, len(sp.logit_bias)))
    for tok, bias in sp.logit_bias:
        if not 0 <= tok < vocab_size:
            raise InvalidRequestError("logit_bias: token id %d is not in [0, %d)" % (tok, vocab_size))
        if not (math.isfinite(bias) and -MAX_BIAS <= bias <= MAX_BIAS):
            raise InvalidRequestError("logit_bias: bias of token %d must be in [-100, 100], got %r" % (tok, bias))
    if not 0 <= sp.min_tokens <= sp.max_tokens:
        raise InvalidRequestError(
            "min_tokens must lie in [0, max_tokens] (max_tokens %d), got %d" % (sp.max_tokens, sp.min_tokens)
        )
    if len(sp.bad_words) > MAX_BAD_WORDS:
        raise InvalidRequestError("bad_words: at most %d words, got %d" % (MAX_BAD_WORDS, len(sp.bad_words)))
    for word in sp.bad_words:
        if not word or len(word) > MAX_BAD_WORD_TOKENS or min(word) < 0 or max(word) >= vocab_size:
            raise InvalidRequestError(
                "bad_words: each word must be 1 to %d token ids in [0, %d)" % (MAX_BAD_WORD_TOKENS, vocab_size)
            )
    if any(not 0 <= t < vocab_size for t in sp.stop_token_ids):
        raise InvalidRequestError("stop_token_ids must lie in [0, %d)" % vocab_size)
    if not (math.isfinite(sp.min_p) and 0.0 <= sp.min_p <= 1.0):
        raise InvalidRequestError("min_p must be a number in [0, 1], got %r" % sp.min_p)
    if sp.allowed_token_ids is not None:
        if not sp.allowed_token_ids:
            raise InvalidRequestError("allowed_token_ids must not be empty")
        if min(sp.allowed_token_ids) < 0 or max(sp.allowed_token_ids) >= vocab_size:
            raise InvalidRequestError("allowed_token_ids must lie in [0, %d)" % vocab_size)
    if sp.logprobs is not None and not 0 <= sp.logprobs <= MAX_LOGPROBS:
        raise InvalidRequestError("logprobs must lie in [0, %d], got %d" % (MAX_LOGPROBS, sp.logprobs))


def required_features(sp: SamplingParams) -> dict[Feature, str]:
    """The engine features ``sp`` needs, each with the request field that asks for it."""
    need: dict[Feature, str] = {}
    if sp.seed is not None:
        need[Feature.SEED] = "seed"
    if sp.presence_penalty:
        need[Feature.PRESENCE_PENALTY] = "presence_penalty"
    if sp.frequency_penalty:
        need[Feature.FREQUENCY_PENALTY] = "frequency_penalty"
    if sp.repetition_penalty != 1.0:
        need[Feature.REPETITION_PENALTY] = "repetition_penalty"
    if sp.logit_bias:
        need[Feature.LOGIT_BIAS] = "logit_bias"
    if sp.min_tokens:
        need[Feature.MIN_TOKENS] = "min_tokens"
    if sp.bad_words:
        need[Feature.BAD_WORDS] = "bad_words"
    if sp.logprobs is not None:
        need[Feature.LOGPROBS] = "logprobs"
    if sp.min_p > GREEDY_EPS and sp.temperature >= GREEDY_EPS:  # vLLM zeroes min_p for greedy requests
        need[Feature.MIN_P] = "min_p"
    if sp.allowed_token_ids is not None:
        need[Feature.ALLOWED_TOKEN_IDS] = "allowed_token_ids"
    if sp.structured is not None:
        need[Feature.STRUCTURED_OUTPUTS] = "response_format / structured_outputs"
    return need


def check_features(sp: SamplingParams, profile: EngineProfile) -> None:
    """InvalidRequestError naming the first field ``sp`` asks for that the engine does not honour."""
    for feature, field in required_features(sp).items():
        if not profile.supports(feature):
            raise InvalidRequestError("%s is not supported by the %s engine" % (field, profile.name))
