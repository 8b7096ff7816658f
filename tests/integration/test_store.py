"""MooncakeStore: round trips across processes, 64 MB objects, checksums."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from hybridpd.errors import IntegrityError
from hybridpd.store import objects
from hybridpd.store.client import CheckpointStore, StoreMissError
from hybridpd.store.master import MooncakeMaster
from tests.integration.store_worker import store_put_worker
from tests.unit.engine_helpers import make_engine, prompt, req


@pytest.fixture()
def store(mooncake_master: MooncakeMaster):  # type: ignore[no-untyped-def]
    s = CheckpointStore(mooncake_master.address, mooncake_master.metadata_url, "test-model")
    yield s
    s.close()


def test_round_trip_across_processes_with_64mb(mooncake_master: MooncakeMaster, store: CheckpointStore) -> None:
    ctx = mp.get_context("spawn")
    q_out, q_in = ctx.Queue(), ctx.Queue()
    p = ctx.Process(
        target=store_put_worker, args=(mooncake_master.address, mooncake_master.metadata_url, "test-model", q_out, q_in)
    )
    p.start()
    try:
        assert q_out.get(timeout=120) == "stored"
        (_, (big,)), (hdr2, small) = (
            store.get_objects(["hpd/test-model/blob/big"], "blob")[0],
            store.get_objects(["hpd/test-model/blob/small"], "blob")[0],
        )
        assert big.numel() == 64 << 20
        assert torch.equal(big, torch.arange(64 << 20, dtype=torch.int64).remainder(251).to(torch.uint8))
        assert hdr2.position == 7 and len(small) == 4
        assert torch.equal(small[0], torch.randn(16, 2, 64, generator=torch.Generator().manual_seed(1)))
    finally:
        q_in.put("done")
        p.join(60)
    assert p.exitcode == 0


def test_flipped_byte_is_detected(store: CheckpointStore) -> None:
    t = torch.randn(1000)
    parts = objects.encode("test-model", "blob", 3, [t])
    data = bytearray(b"".join(bytes(p) for p in parts))
    assert objects.decode(bytes(data), "test-model", "blob")[1][0].equal(t)
    data[-5] ^= 0x01
    store.store.put("hpd/test-model/blob/bad", bytes(data))
    with pytest.raises(IntegrityError, match="checksum"):
        store.get_objects(["hpd/test-model/blob/bad"], "blob")
    with pytest.raises(IntegrityError):
        objects.decode(bytes(data[:20]), "test-model", "blob")
    with pytest.raises(IntegrityError, match="expected"):
        objects.decode(b"".join(bytes(p) for p in parts), "other-model", "blob")


def test_checkpoint_round_trip_into_engine(store: CheckpointStore) -> None:
    toks = prompt(400, 21)
    src = make_engine(export_checkpoints=True)
    src.generate([req("w", toks[:300], 1)])
    ((kv, st),) = src.pop_exports()
    store.model_id = src.model_id
    res = store.put_checkpoint(kv, st, 16)
    assert res.objects_written == len(kv.block_hashes) + 1  # every block of [0, p) + the state
    kv2, st2 = store.get_checkpoint(list(kv.block_hashes[: st.meta.position // 16]), 16)
    assert st2.key == st.key and st2.meta.position == st.meta.position
    p = st.meta.position
    for a, b in zip(kv.buffers, kv2.buffers, strict=True):
        assert torch.equal(a[:p], b)
    for a, b in zip(st.buffers, st2.buffers, strict=True):
        assert torch.equal(a, b)
    # a second put writes only the state (blocks are shared)
    assert store.put_checkpoint(kv, st, 16).objects_written == 1
    dst = make_engine()
    assert dst.import_checkpoint(kv2, st2, list(toks))
    out = dst.generate([req("r", toks, 4)])
    ref = make_engine(enable_prefix_caching=False).generate([req("r", toks, 4)])
    assert out == ref


def test_missing_object(store: CheckpointStore) -> None:
    with pytest.raises(StoreMissError):
        store.get_objects(["hpd/test-model/blob/never-written"], "blob")
