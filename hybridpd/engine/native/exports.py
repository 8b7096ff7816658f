"""Copy request state out of (and into) the engine's paged storage.

Exported buffers are contiguous, owned copies: the engine may free or reuse
its blocks right after exporting, and NIXL / MooncakeStore can register or
store the buffers as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridpd.engine.base import BufferMeta, KVExport, StateCheckpoint
from hybridpd.engine.native.attention import AttentionLayer
from hybridpd.engine.native.delta import DeltaState
from hybridpd.engine.native.handoff import DraftState
from hybridpd.errors import IntegrityError
from hybridpd.hashing import BlockHash


def _meta(model_id: str, kind: str, position: int, bufs: Sequence[torch.Tensor], group: str) -> BufferMeta:
    return BufferMeta(
        model_id, kind, position, str(bufs[0].dtype).removeprefix("torch."), tuple(tuple(b.shape) for b in bufs), group
    )


def export_kv(
    model_id: str,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    block_table: list[int],
    length: int,
    block_hashes: Sequence[BlockHash] = (),
) -> KVExport:
    bufs: list[torch.Tensor] = []
    for k_cache, v_cache in kv_caches:
        bufs.append(AttentionLayer.gather(k_cache, block_table, length, length).contiguous())
        bufs.append(AttentionLayer.gather(v_cache, block_table, length, length).contiguous())
    return KVExport(_meta(model_id, "kv", length, bufs, "attention"), tuple(bufs), tuple(block_hashes))


def import_kv(
    kv: KVExport,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    block_table: list[int],
    first_token: int = 0,
    end: int | None = None,
) -> None:
    """Write tokens ``[first_token, end)`` of ``kv`` into the cache (``end``:
    ``kv.meta.position`` if None)."""
    stop = kv.meta.position if end is None else end
    for li, (k_cache, v_cache) in enumerate(kv_caches):
        k, v = kv.buffers[2 * li], kv.buffers[2 * li + 1]
        AttentionLayer.write(k_cache, block_table, first_token, k[first_token:stop])
        AttentionLayer.write(v_cache, block_table, first_token, v[first_token:stop])


def export_state(
    model_id: str, states: Sequence[DeltaState], position: int, key: BlockHash | None, speculative: bool = False
) -> StateCheckpoint:
    bufs: list[torch.Tensor] = []
    for st in states:
        bufs.append(st.conv.contiguous().clone())
        bufs.append(st.ssm.contiguous().clone())
    return StateCheckpoint(_meta(model_id, "state", position, bufs, "delta"), key, tuple(bufs), speculative)


def import_state(state: StateCheckpoint, device: torch.device) -> list[DeltaState]:
    b = state.buffers
    return [DeltaState(b[i].to(device).clone(), b[i + 1].to(device).clone()) for i in range(0, len(b), 2)]


def export_draft(model_id: str, hidden: torch.Tensor, position: int) -> DraftState:
    buf = hidden.detach().contiguous().clone()
    return DraftState(_meta(model_id, "draft", position, [buf], "draft"), (buf,))


def check_meta(meta: BufferMeta, model_id: str, kind: str, shapes: Sequence[tuple[int, ...]]) -> None:
    """Raise IntegrityError unless ``meta`` describes what we expect."""
    if meta.model_id != model_id or meta.kind != kind:
        raise IntegrityError("expected %s of model %s, got %s of %s" % (kind, model_id, meta.kind, meta.model_id))
    if tuple(meta.shapes) != tuple(shapes):
        raise IntegrityError("%s shapes %s differ from expected %s" % (kind, meta.shapes, tuple(shapes)))
