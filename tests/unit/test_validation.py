"""Request validation (``hybridpd/validation.py``): the extra checkpoint
positions a client may name (``hybridpd_checkpoints``)."""

from __future__ import annotations

import pytest

from hybridpd.checkpoints import MAX_REQUESTED_CHECKPOINTS
from hybridpd.engine.base import EngineRequest, RequestId, SamplingParams
from hybridpd.errors import InvalidRequestError
from hybridpd.validation import validate_request


def _req(n: int, checkpoints: tuple[int, ...]) -> EngineRequest:
    return EngineRequest(RequestId("v"), tuple(range(5, 5 + n)), SamplingParams(max_tokens=4), None, checkpoints)


def test_checkpoints_accepted() -> None:
    validate_request(_req(100, ()), 2048, 4096)
    validate_request(_req(100, (1, 20, 99)), 2048, 4096)
    validate_request(_req(100, tuple(range(10, 10 + MAX_REQUESTED_CHECKPOINTS))), 2048, 4096)


@pytest.mark.parametrize(
    ("checkpoints", "message"),
    [
        ((40, 20), "strictly ascending: 20 follows 40"),
        ((20, 20), "strictly ascending: 20 follows 20"),
        ((0, 20), "position 0 is not inside the prompt"),
        ((20, 100), "position 100 is not inside the prompt"),
        ((-3,), "position -3 is not inside the prompt"),
        (tuple(range(1, 2 + MAX_REQUESTED_CHECKPOINTS)), "at most %d positions" % MAX_REQUESTED_CHECKPOINTS),
        ((True,), "must be integers"),
    ],
)
def test_checkpoints_refused(checkpoints: tuple[int, ...], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        validate_request(_req(100, checkpoints), 2048, 4096)
