"""Request validation: the one place its rules and messages live.

The router calls it before routing (both APIs: HTTP and gRPC map the
InvalidRequestError to 400 / INVALID_ARGUMENT); the native engine calls it
again on ``add_request`` and ``add_handoff`` so an engine driven directly
(tests, benchmarks) refuses the same requests with the same messages.
"""

from __future__ import annotations

import math

from hybridpd.checkpoints import MAX_REQUESTED_CHECKPOINTS
from hybridpd.engine.base import EngineRequest
from hybridpd.errors import InvalidRequestError

#: torch.Generator.manual_seed accepts exactly this range.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


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
