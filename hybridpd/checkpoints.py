"""The checkpoint protocol: the single source of where recurrent state is
exported, promised, looked up and restored (mirrors vLLM PR #53614).

Names: ``u`` = prefix_match_unit (hash block size), ``B`` = mamba block size,
``a`` = checkpoint alignment (the prefill kernel exports state only at offsets
that are multiples of ``a`` from the query start), ``N`` = tokens the main
model computes for the request.

One set of functions serves the scheduler, the kernel-metadata builder, the
router and the index publisher, so a checkpoint is promised only where it is
written. Prefixes prefilled to leave a checkpoint (vLLM) follow these rules in
``checkpoint_stages.py``; why a routed prompt's tokens missed, in
``prefix_outcomes.py``.

State slot columns (vLLM "align" mode)::

    tokens   0        B        2B       3B       4B
             |--------|--------|--------|--------|
    column       0        1        2        3
    natural  state@B  state@2B state@3B state@4B

A prefill whose query ends at ``end`` writes its partial-prefix checkpoint
into column ``ceil(end / B) - 2``, whose natural key is ``state@(col+1)*B``.
When the checkpoint position differs from that natural boundary (partial
checkpoints, or EAGLE's dropped block with u = B) the slot must be re-keyed to
the chain hash at the checkpoint position (:func:`needs_rekey`), or a later
restore returns state@pos labelled as state@natural: silent corruption.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence


def _ceil_div(x: int, y: int) -> int:
    return -(-x // y)


def checkpoint_position(num_tokens: int, unit: int, drop_eagle_block: bool) -> int:
    """Where a request of ``num_tokens`` exports its partial-prefix state.

    The last full unit boundary strictly before the final token; with EAGLE
    one unit lower, the boundary a later hit replays from (the attention
    group drops its last matched block under EAGLE).

    >>> checkpoint_position(100, 8, False), checkpoint_position(100, 8, True)
    (96, 88)
    """
    if unit <= 0:
        raise ValueError("unit must be positive, got %d" % unit)
    if num_tokens < 0:
        raise ValueError("num_tokens must be >= 0, got %d" % num_tokens)
    return max((num_tokens - 1) // unit * unit - (unit if drop_eagle_block else 0), 0)


def checkpoint_slot_column(query_end: int, mamba_block_size: int) -> int:
    """The state slot column a prefill ending at ``query_end`` writes into."""
    return _ceil_div(query_end, mamba_block_size) - 2


def extra_slot_column(position: int, mamba_block_size: int) -> int:
    """The state slot column an extra checkpoint at ``position`` takes: the
    column of the block holding token ``position - 1`` (natural key
    state@``(col + 1) * B``, so a position inside a Mamba block is re-keyed)."""
    return _ceil_div(position, mamba_block_size) - 1


def natural_position(column: int, mamba_block_size: int) -> int:
    """The state boundary a slot column holds when nothing re-keys it."""
    return (column + 1) * mamba_block_size


def is_checkpoint_valid(
    query_start: int,
    query_end: int,
    position: int,
    unit: int,
    mamba_block_size: int,
    alignment: int | None,
) -> bool:
    """Whether the kernel can write state@``position`` for this query.

    ``query_start``/``query_end`` bound the tokens computed in this step.
    Valid iff all hold:

    - an alignment is known (``None`` means the kernel cannot export);
    - the query starts on a unit boundary;
    - the slot column ``ceil(end/B) - 2`` lies past the column holding the
      initial state ``(start - 1) // B`` (it must not overwrite it);
    - at least one unit is computed before the checkpoint;
    - the position lies strictly inside the query;
    - the offset from the query start is a multiple of the alignment.
    """
    if alignment is None:
        return False
    return (
        query_start % unit == 0
        and checkpoint_slot_column(query_end, mamba_block_size) > (query_start - 1) // mamba_block_size
        and query_start + unit <= position
        and query_start < position < query_end
        and (position - query_start) % alignment == 0
    )


def planned_checkpoint(
    query_start: int,
    query_end: int,
    num_tokens: int,
    unit: int,
    mamba_block_size: int,
    alignment: int | None,
    drop_eagle_block: bool,
) -> int | None:
    """The checkpoint a step computing ``[query_start, query_end)`` exports, or None.

    The position is :func:`checkpoint_position` of the whole request; a step
    exports it only when it lies in this step and is valid.
    """
    pos = checkpoint_position(num_tokens, unit, drop_eagle_block)
    if is_checkpoint_valid(query_start, query_end, pos, unit, mamba_block_size, alignment):
        return pos
    return None


#: at most this many extra checkpoint positions per request (client positions,
#: junctions); the API refuses longer lists, the engine keeps the deepest
MAX_REQUESTED_CHECKPOINTS = 8


def junction_position(junction: int, unit: int, drop_eagle_block: bool) -> int:
    """The checkpoint a later request sharing exactly ``[0, junction)`` hits.

    The request continues past the junction, so every unit block ending at or
    before it is shared: the position is ``junction // u * u``, with EAGLE one
    unit lower (the replay rule of :func:`checkpoint_position`, which this is
    for ``junction + 1`` tokens).

    >>> junction_position(100, 8, False), junction_position(100, 8, True), junction_position(96, 8, False)
    (96, 88, 96)
    """
    return checkpoint_position(junction + 1, unit, drop_eagle_block)


def is_extra_checkpoint_valid(
    query_start: int,
    query_end: int,
    position: int,
    unit: int,
    mamba_block_size: int,
    alignment: int | None,
) -> bool:
    """Whether an extra (requested) checkpoint at ``position`` can be written
    by a prefill computing ``[query_start, query_end)``.

    Everything :func:`is_checkpoint_valid` demands of the tail checkpoint,
    plus the slot-column rule for the position itself: state@``position``
    belongs in column :func:`extra_slot_column` ``= ceil(position / B) - 1``
    (the tail takes ``ceil(end / B) - 2``), which must lie past the
    column holding the initial state, ``(start - 1) // B``, or writing it
    would overwrite the state this prefill restored from.
    """
    return (
        is_checkpoint_valid(query_start, query_end, position, unit, mamba_block_size, alignment)
        and extra_slot_column(position, mamba_block_size) > (query_start - 1) // mamba_block_size
    )


def requested_checkpoints(
    requested: Sequence[int],
    hit: int,
    num_tokens: int,
    unit: int,
    mamba_block_size: int,
    alignment: int | None,
    drop_eagle_block: bool,
    max_extra: int = MAX_REQUESTED_CHECKPOINTS,
) -> tuple[int, ...]:
    """The extra checkpoints a prefill of ``[hit, num_tokens)`` writes for
    ``requested`` junctions (token counts: a branch point, message ends, client
    positions), ascending; the tail checkpoint (:func:`planned_checkpoint`) is
    not among them.

    Each junction ``r``:

    1. becomes :func:`junction_position` (down to a unit boundary; with EAGLE
       one unit lower, the block a later hit replays);
    2. moves down, in units, to the first position whose offset from ``hit``
       the alignment allows (``(p - hit) % a == 0``);
    3. is kept iff :func:`is_extra_checkpoint_valid` holds (at least one unit
       above the hit, inside the query, the column past the initial state's)
       and it lies below the tail position
       ``checkpoint_position(num_tokens)`` (the tail is planned anyway).
       A position the column rule forbids is dropped: every lower position
       lies in the same column or an earlier one.

    Duplicates collapse; of more than ``max_extra`` the deepest are kept (they
    save the most on a hit).

    Chunk boundaries: the native kernel holds the state at every multiple of
    16 inside a chunk and at its end, and every kept position is
    ``hit + k * a`` with ``16 | a``, so no boundary is needed for a position
    to be written. The native scheduler snapshots at most one position per
    chunk (as a kernel writing one partial checkpoint per query must): a
    chunk that would contain two ends at the first.

    ``u=8, B=64, a=16``, junctions 20, 41 and 90 of a 100-token prompt from 0:
    20 -> 16; 41 -> 40 -> 32 (40 is not a multiple of 16); 90 -> 88 -> 80.

    >>> requested_checkpoints([20, 41, 90], 0, 100, 8, 64, 16, False)
    (16, 32, 80)

    With EAGLE each is one unit lower first: 20 -> 8 -> 0 (not above the
    hit: dropped), 41 -> 32, 90 -> 80; the tail is 88 (itself invalid:
    88 % 16 != 0, so only the extras are written):

    >>> requested_checkpoints([20, 41, 90], 0, 100, 8, 64, 16, True)
    (32, 80)

    A junction in the initial state's slot column: a hit of 32 restores
    state@32 from column 0 (``B=64``). Junction 40 -> 32 is the hit itself;
    60 -> 48 and 64 -> 64 need column 0 too: dropped; 96 needs column 1:

    >>> requested_checkpoints([40, 60, 64, 96], 32, 200, 16, 64, 16, False)
    (96,)
    """
    if alignment is None or max_extra <= 0:
        return ()
    tail = checkpoint_position(num_tokens, unit, drop_eagle_block)
    kept: set[int] = set()
    for r in requested:
        pos = junction_position(min(max(r, 0), num_tokens), unit, drop_eagle_block)
        while pos > hit and (pos - hit) % alignment:
            pos -= unit
        if pos < tail and is_extra_checkpoint_valid(hit, num_tokens, pos, unit, mamba_block_size, alignment):
            kept.add(pos)
    return tuple(sorted(kept)[-max_extra:])


def needs_rekey(position: int, query_end: int, mamba_block_size: int) -> bool:
    """True when the written slot's natural key is not state@``position``."""
    return natural_position(checkpoint_slot_column(query_end, mamba_block_size), mamba_block_size) != position


def leading_blocks(attention_blocks: Sequence[bool]) -> int:
    """Number of consecutive present blocks from block 0."""
    n = 0
    for present in attention_blocks:
        if not present:
            break
        n += 1
    return n


def known_prefix(num_tokens: int, unit: int, attention_blocks: Sequence[bool] | int) -> int:
    """How far (tokens) a prompt of ``num_tokens`` has its attention blocks
    cached: the leading run, capped like a hit (at least one token is computed),
    without the EAGLE drop. The index reports the longest over every group; past
    the usable hit it is the junction where the prompt leaves every known prefix.

    >>> known_prefix(100, 16, [True] * 4 + [False, True]), known_prefix(64, 16, 10)
    (64, 48)
    """
    if num_tokens <= 0:
        return 0
    leading = attention_blocks if isinstance(attention_blocks, int) else leading_blocks(attention_blocks)
    return min(leading, (num_tokens - 1) // unit) * unit


def longest_usable_hit(
    num_tokens: int,
    unit: int,
    attention_blocks: Sequence[bool] | int,
    state_positions: Collection[int],
    drop_eagle_block: bool,
) -> int:
    """Longest prefix (in tokens) restorable for a request of ``num_tokens``.

    ``attention_blocks[i]`` says whether KV for block ``i`` (tokens
    ``[i*u, (i+1)*u)``) exists; an int means that many leading blocks exist.
    ``state_positions`` are token positions with a recurrent-state checkpoint.

    Hit rule (vLLM hybrid coordinator): the attention group finds its longest
    run of blocks, capped at ``num_tokens - 1`` (at least one token is
    computed) and, with EAGLE, drops its last matched block once; the state
    group then finds its longest checkpoint at or below that; the attention
    group truncates to agree. The result is 0 or a positive multiple of
    ``unit`` at which a state checkpoint exists.
    """
    if num_tokens <= 0:
        return 0
    leading = attention_blocks if isinstance(attention_blocks, int) else leading_blocks(attention_blocks)
    blocks = min(leading, (num_tokens - 1) // unit)
    if drop_eagle_block and blocks > 0:
        blocks -= 1
    cap = blocks * unit
    best = 0
    for pos in state_positions:
        if 0 < pos <= cap and pos % unit == 0 and pos > best:
            best = pos
    return best


def merge_requested(client: Sequence[int], derived: Sequence[int], num_tokens: int) -> tuple[int, ...]:
    """One request's extra checkpoint positions: what the client named
    (``hybridpd_checkpoints``, already validated) and what the router derived
    (a junction from the index, chat message boundaries), ascending, each in
    ``(0, num_tokens)``, at most :data:`MAX_REQUESTED_CHECKPOINTS`: every
    derived one first, then the client's deepest. The engine makes positions
    of them (:func:`requested_checkpoints`).

    >>> merge_requested([10, 50], [50, 120, 0], 100)
    (10, 50)
    >>> merge_requested(list(range(1, 9)), [40], 100)
    (2, 3, 4, 5, 6, 7, 8, 40)
    """
    keep = sorted({p for p in derived if 0 < p < num_tokens})[-MAX_REQUESTED_CHECKPOINTS:]
    room = MAX_REQUESTED_CHECKPOINTS - len(keep)
    rest = sorted({p for p in client if 0 < p < num_tokens} - set(keep))
    return tuple(sorted(keep + (rest[len(rest) - room :] if room > 0 else [])))
