"""MooncakeStore: round trips across processes, 64 MB objects, checksums, keyed tags
(two keys never accept each other's objects; a forged state is refused, deleted and
recomputed exactly by a prefill worker on a real Redis and mooncake_master)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from hybridpd.config import load_config
from hybridpd.engine.base import EngineRequest, RequestId, SamplingParams
from hybridpd.engine.native.engine import NativeEngine
from hybridpd.errors import IntegrityError
from hybridpd.index.prefix_index import PrefixIndex
from hybridpd.index.redis_server import RedisServer
from hybridpd.integrity import PUBLIC, STORE_OBJECT, IntegrityKey, write_key_file
from hybridpd.models.bundled import resolve_model_dir
from hybridpd.store import objects
from hybridpd.store.client import BadObjectError, CheckpointStore, StoreMissError
from hybridpd.store.master import MooncakeMaster
from services.prefill.actor import PrefillWorker
from services.worker.messages import PrefillCommand
from tests.integration.store_worker import store_put_worker
from tests.unit.engine_helpers import make_engine, prompt, req
from tests.wait import Pending, wait_until


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


KEYS = {
    "public": PUBLIC,
    "A": IntegrityKey(b"store test key A: 32 bytes long.."),
    "B": IntegrityKey(b"store test key B"),
}


def test_two_keys_never_accept_each_others_objects(mooncake_master: MooncakeMaster) -> None:
    master = (mooncake_master.address, mooncake_master.metadata_url)
    stores = {n: CheckpointStore(*master, "test-model", key=k) for n, k in KEYS.items()}
    t = torch.randn(4, 64, generator=torch.Generator().manual_seed(5))
    try:
        for writer, ws in stores.items():
            name = "hpd/test-model/blob/by-%s" % writer
            ws.put_objects([(name, "blob", 1, [t])])
            for reader, rs in stores.items():
                if reader == writer:
                    assert torch.equal(rs.get_objects([name], "blob")[0][1][0], t)
                    continue
                with pytest.raises(BadObjectError, match="keyed tag fails") as exc:
                    rs.get_objects([name], "blob")
                assert exc.value.forged and exc.value.name == name
            ws.remove([name])
    finally:
        for st in stores.values():
            st.close()


def _tail_req(rid: str, tokens: tuple[int, ...]) -> EngineRequest:
    # max_tokens=1: the request finishes at prefill (no handoff to offer)
    return EngineRequest(RequestId(rid), tokens, SamplingParams(max_tokens=1, ignore_eos=True))


@pytest.mark.usefixtures("fp32_row_exact")
def test_a_forged_state_is_refused_deleted_and_the_prefill_recomputes_exactly(
    redis_server: RedisServer, mooncake_master: MooncakeMaster, tmp_path: Path
) -> None:
    """A peer that reaches the store but not the key overwrites a shared prefix's state
    object with a state of its own, checksummed correctly and tagged with the public key.
    The next prefill promised that hit refuses it (nothing restored, counted as a tag
    failure), deletes it and its index entry, and its first token is the plain run's. A
    genuine object of the same key is loaded (the control: loads work, the tag refused)."""
    cfg = load_config(env={}, overrides={"integrity_key_file": str(write_key_file(tmp_path / "integrity.key"))})
    master = (mooncake_master.address, mooncake_master.metadata_url)
    engines = [
        NativeEngine(
            cfg, resolve_model_dir(cfg.model), role="prefill", instance="prefill-tag-%d" % i, export_checkpoints=True
        )
        for i in range(2)
    ]
    w0, w1 = (PrefillWorker(cfg, e.instance, redis_server.url, *master, engine=e) for e in engines)
    plain = make_engine(enable_prefix_caching=False)
    index = PrefixIndex(redis_server.url, engines[0].model_id)
    u = engines[0].unit
    try:
        assert w0.store is not None and w1.store is not None

        def shared(seed: int) -> tuple[tuple[int, ...], tuple[int, ...], int, str]:
            """A prompt prefilled on w0 and an extension of it: the store hit the index
            promises the extension, and the name of that hit's state object."""
            base = prompt(96, seed)
            ext = base + prompt(40, seed + 1)
            w0.prefill(PrefillCommand(_tail_req("base-%d" % seed, base)))
            assert w0.publisher.settle(60)
            chain = engines[0].hasher.chain(list(ext))

            def hit() -> int | Pending:
                got = index.lookup(chain, len(ext), u, False).store_hit
                return got if got > 0 else Pending(got)

            pos = wait_until(hit, 30, 0.05, "the base's checkpoint in the index")
            return base, ext, pos, w0.store.key("st", chain[pos // u - 1])  # type: ignore[union-attr]

        # the control: a genuine object is loaded
        _, ext, pos, _ = shared(9100)
        res = w1.prefill(PrefillCommand(_tail_req("genuine", ext), store_hit=pos))
        assert (res.loaded_from_store, res.num_cached_tokens) == (pos, pos)
        assert res.token_ids == tuple(plain.generate([_tail_req("p1", ext)])["p1"])
        assert (w1.counters.prefill_store_loads, w1.counters.store_tag_failures) == (1, 0)

        # the forgery: the same object's name, a changed state, a valid checksum, no key
        base, ext, pos, name = shared(9200)
        ((hdr, bufs),) = w0.store.get_objects([name], "state")
        forged = [b.clone() for b in bufs]
        forged[0].view(-1)[:64] += 1.0
        parts = objects.encode(hdr.model, "state", pos, forged, name=name, tagger=PUBLIC.tagger(STORE_OBJECT))
        assert objects._header(b"".join(bytes(p) for p in parts))[0].xxh3 == objects.checksum(forged)
        assert w0.store.remove([name]) == [] and w0.store.store.put_parts(name, *parts) == 0
        with pytest.raises(BadObjectError) as exc:
            w1.store.get_objects([name], "state")
        assert exc.value.forged  # its checksum holds: only the tag tells
        res = w1.prefill(PrefillCommand(_tail_req("forged", ext), store_hit=pos))
        assert (res.loaded_from_store, res.num_cached_tokens) == (0, 0)  # nothing restored from it
        assert res.token_ids == tuple(plain.generate([_tail_req("p2", ext)])["p2"])
        c = w1.counters
        assert (c.prefill_store_loads, c.prefill_store_load_failures, c.store_tag_failures) == (1, 1, 1)
        assert w1.store.exists([name]) == [False]  # deleted
        chain = engines[0].hasher.chain(list(base))
        assert not index.r.exists(index.keys.st(chain[pos // u - 1]))  # no longer promised
    finally:
        w0.close()
        w1.close()
