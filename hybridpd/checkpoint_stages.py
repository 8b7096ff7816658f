"""Checkpoints an engine leaves by prefilling prompt prefixes first (vLLM).

vLLM 0.32 keeps a partial-prefix state only at a prompt's tail, so a checkpoint
at a position the router chose (a junction, a chat boundary, a client
position, a placed one) is left by prefilling the prefix whose tail it is, as a
request of its own, before the prompt (``engine/vllm/stages.py`` runs them).
Positions follow the rules of ``checkpoints.py`` (:func:`checkpoint_position`,
:func:`junction_position`); each rule here carries its worked doctest.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridpd.checkpoints import MAX_REQUESTED_CHECKPOINTS, checkpoint_position, junction_position


def stage_length(position: int, unit: int, drop_eagle_block: bool) -> int:
    """The prompt prefix whose tail checkpoint is ``position`` (a multiple of
    ``unit``) under both tail rules, ours (:func:`checkpoint_position`) and
    vLLM 0.32's (``get_mamba_prefill_checkpoint_position``: ``N // u * u - u``
    under EAGLE): one token past it, with EAGLE one unit and one token past it
    (so the attention entry a later EAGLE hit drops from is ``position + u``).

    >>> stage_length(96, 16, False), stage_length(96, 16, True)
    (97, 113)
    >>> checkpoint_position(97, 16, False), checkpoint_position(113, 16, True), 113 // 16 * 16 - 16
    (96, 96, 96)
    """
    return position + 1 + (unit if drop_eagle_block else 0)


def staged_checkpoints(
    requested: Sequence[int],
    num_tokens: int,
    unit: int,
    drop_eagle_block: bool,
    max_extra: int = MAX_REQUESTED_CHECKPOINTS,
    placed: Sequence[int] = (),
) -> tuple[tuple[int, int], ...]:
    """For an engine that keeps a partial-prefix state only at a prompt's tail
    (vLLM): the ``(position, prefix length)`` prefills that leave the extra
    checkpoints ``requested`` asks for, ascending, run one after another before
    the prompt itself (``num_tokens``: the tokens that prefill computes).

    Each junction ``r`` becomes :func:`junction_position` (the checkpoint a later
    request sharing ``[0, r)`` hits), kept iff above 0 and below the prompt's own
    tail; duplicates collapse; of more than ``max_extra`` the deepest are kept.
    The prefix length is :func:`stage_length`. No alignment or slot-column rule
    applies: each prefix is a prompt of its own, whose tail vLLM writes itself.
    ``placed`` (the router's placement: checkpoint positions, not junctions) are
    staged as they are, those that are unit multiples below the tail, besides
    the ``max_extra`` requested ones.

    >>> staged_checkpoints([20, 41, 90], 100, 8, False)
    ((16, 17), (40, 41), (88, 89))
    >>> staged_checkpoints([20, 41, 90, 99], 100, 8, True)
    ((8, 17), (32, 41), (80, 89))
    >>> staged_checkpoints([5, 1000, 1500], 1600, 16, False, max_extra=1)
    ((1488, 1489),)
    >>> staged_checkpoints([90], 100, 8, True, placed=[40, 44, 96])
    ((40, 49), (80, 89))
    """
    tail = checkpoint_position(num_tokens, unit, drop_eagle_block)
    kept = {junction_position(min(max(r, 0), num_tokens), unit, drop_eagle_block) for r in requested}
    chosen = set(sorted(p for p in kept if 0 < p < tail)[-max_extra:] if max_extra > 0 else ())
    chosen |= {p for p in placed if 0 < p < tail and p % unit == 0}
    return tuple((p, stage_length(p, unit, drop_eagle_block)) for p in sorted(chosen))


def truncated_tail_stage(num_tokens: int, computed: int, unit: int, drop_eagle_block: bool) -> tuple[int, int] | None:
    """A prompt of ``num_tokens`` whose prefill computes only ``computed`` of them
    (vLLM's P/D prefill: decode recomputes the rest) leaves its tail at
    ``checkpoint_position(computed)``, a unit below one engine's when
    ``computed`` crosses a unit boundary (``num_tokens = k u + 1``, one token of
    backoff). The ``(position, prefix length)`` to stage so the prompt's own
    tail exists, as one engine would leave it for a next turn that extends the
    prompt; None when the truncated tail is already there.

    >>> truncated_tail_stage(97, 96, 16, False), truncated_tail_stage(98, 97, 16, False)
    ((96, 97), None)
    >>> truncated_tail_stage(97, 96, 16, True)
    (80, 97)
    """
    full = checkpoint_position(num_tokens, unit, drop_eagle_block)
    if full <= checkpoint_position(computed, unit, drop_eagle_block):
        return None
    return full, stage_length(full, unit, drop_eagle_block)
