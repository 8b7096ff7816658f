"""Keyed integrity (``hybridpd/integrity.py``): the deployment key and its file, store
objects and handoff descriptors tagged with it (two keys never accept each other's),
the block-hash seed derived from it, and what the workers count when a tag fails.
Token frames: ``test_token_channel.py``; a real store: ``tests/integration/test_store.py``."""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
from pathlib import Path

import pytest
import torch
import xxhash
from click.testing import CliRunner

from hybridpd.config import load_config
from hybridpd.errors import ConfigError, IntegrityError
from hybridpd.integrity import (
    HANDOFF,
    PUBLIC,
    PURPOSES,
    STORE_OBJECT,
    IntegrityKey,
    TagError,
    block_hash_seed,
    load_key,
    read_key,
    stack_key,
    write_key_file,
)
from hybridpd.store import objects
from hybridpd.store.client import BadObjectError
from hybridpd.transfer.handoff_descriptor import BufferSpec, HandoffDescriptor, check_descriptor, tag_descriptor
from launch.cli import cli
from services.decode.actor import DecodeWorker
from services.prefill.actor import PrefillWorker
from services.worker.messages import PrefillCommand
from tests.unit.engine_helpers import make_engine, prompt, req
from tests.unit.toy_engine import ToyEngine

pytestmark = pytest.mark.unit

A = IntegrityKey(b"deployment key A, 32 bytes long.")
B = IntegrityKey(b"deployment key B, 32 bytes long.")
KEYS = {"public": PUBLIC, "A": A, "B": B}


def _key_file(tmp_path: Path, name: str = "integrity.key") -> Path:
    return write_key_file(tmp_path / name)


# -- the key -----------------------------------------------------------------------------------
def test_a_key_file_is_read_stripped_and_refused_when_short_or_missing(tmp_path: Path) -> None:
    (tmp_path / "k").write_bytes(b"  a-secret-of-more-than-16-bytes\n")
    assert read_key(tmp_path / "k").secret == b"a-secret-of-more-than-16-bytes"
    (tmp_path / "short").write_bytes(b"0123456789\n")
    with pytest.raises(ConfigError, match="at least 16") as exc:
        read_key(tmp_path / "short")
    assert exc.value.field == "integrity_key_file"
    with pytest.raises(ConfigError, match="no such file") as exc:
        load_config(env={}, overrides={"integrity_key_file": str(tmp_path / "absent")})
    assert exc.value.field == "integrity_key_file"
    assert load_key(load_config(env={})) is PUBLIC and not PUBLIC.keyed


def test_a_written_key_file_is_private_random_and_never_overwritten(tmp_path: Path) -> None:
    path = _key_file(tmp_path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert len(read_key(path).secret) == 64 and read_key(path) != read_key(_key_file(tmp_path, "other"))
    with pytest.raises(FileExistsError):
        write_key_file(path)


def test_the_key_never_shows_in_a_repr(tmp_path: Path) -> None:
    key = read_key(_key_file(tmp_path))
    tagger = key.tagger(STORE_OBJECT)
    for text in (repr(key), str(key), repr(tagger)):
        assert key.secret.decode() not in text and tagger.subkey.hex() not in text and "secret" not in text.lower()


def test_each_purpose_has_its_own_subkey() -> None:
    subkeys = {A.tagger(p).subkey for p in PURPOSES}
    assert len(subkeys) == len(PURPOSES)
    with pytest.raises(ValueError, match="purpose"):
        A.tagger("anything")


# -- store objects -----------------------------------------------------------------------------
def _object(key: IntegrityKey, name: str = "hpd/m/st/ab", delta: float = 0.0) -> bytes:
    bufs = [torch.arange(48, dtype=torch.float32).reshape(4, 12) + delta, torch.ones(3, dtype=torch.float32)]
    parts = objects.encode("m", "state", 32, bufs, name=name, tagger=key.tagger(STORE_OBJECT))
    return b"".join(bytes(p) for p in parts)


@pytest.mark.parametrize("writer", list(KEYS))
@pytest.mark.parametrize("reader", list(KEYS))
def test_two_keys_never_accept_each_others_objects(writer: str, reader: str) -> None:
    data = _object(KEYS[writer])
    tagger = KEYS[reader].tagger(STORE_OBJECT)
    if writer == reader:
        hdr, bufs = objects.decode(data, "m", "state", name="hpd/m/st/ab", tagger=tagger)
        assert hdr.position == 32 and torch.equal(bufs[1], torch.ones(3))
        return
    with pytest.raises(TagError, match="valid checksum but its keyed tag fails"):
        objects.decode(data, "m", "state", name="hpd/m/st/ab", tagger=tagger)


def test_a_forged_object_has_a_valid_checksum_and_is_still_refused() -> None:
    """The attack: a peer without the key writes a state of its choosing, checksummed
    correctly (xxh3 is public), under a shared prompt's name."""
    forged = _object(PUBLIC, delta=1.0)
    hdr, start, _ = objects._header(forged)
    assert xxhash.xxh3_64_hexdigest(forged[start:]) == hdr.xxh3  # what the old format checked
    with pytest.raises(TagError):
        objects.decode(forged, "m", "state", name="hpd/m/st/ab", tagger=A.tagger(STORE_OBJECT))


def test_an_object_moved_to_another_name_or_corrupted_is_refused() -> None:
    data = _object(A)
    with pytest.raises(TagError):  # a real object copied under another prefix's key
        objects.decode(data, "m", "state", name="hpd/m/st/cd", tagger=A.tagger(STORE_OBJECT))
    flipped = bytearray(data)
    flipped[-5] ^= 0x01
    with pytest.raises(IntegrityError, match="checksum mismatch") as exc:
        objects.decode(bytes(flipped), "m", "state", name="hpd/m/st/ab", tagger=A.tagger(STORE_OBJECT))
    assert not isinstance(exc.value, TagError)  # corrupt, not forged
    assert not BadObjectError("k", exc.value).forged and BadObjectError("k", TagError("x")).forged


# -- handoff descriptors -----------------------------------------------------------------------
def _descriptor() -> HandoffDescriptor:
    kv = BufferSpec((4, 2, 8), "float32", 256, "", 4096, 0, 1, ("aa", "bb", "cc", "dd"))
    st = BufferSpec((3, 16), "float32", 192, "ee", 8192)
    return HandoffDescriptor("r~1", "prefill-0", b"agent-metadata", "DRAM", (kv, st), 1.7e9)


def test_a_descriptor_is_refused_when_any_field_or_its_context_changes_or_another_key_tagged_it() -> None:
    t = A.tagger(HANDOFF)
    desc = tag_descriptor(_descriptor(), t, b"ticket")
    check_descriptor(desc, t, b"ticket")
    kv, st = desc.buffers
    changed = [
        dataclasses.replace(desc, agent_name="attacker"),
        dataclasses.replace(desc, agent_metadata=b"another agent"),
        dataclasses.replace(desc, expires_at=desc.expires_at + 60),
        dataclasses.replace(desc, mem_type="VRAM"),
        dataclasses.replace(desc, handoff_id="r~2"),
        dataclasses.replace(desc, buffers=(dataclasses.replace(kv, chunk_xxh3=("aa", "bb", "cc", "00")), st)),
        dataclasses.replace(desc, buffers=(kv, dataclasses.replace(st, xxh3="ff"))),
        dataclasses.replace(desc, buffers=(kv, dataclasses.replace(st, addr=12288))),
        dataclasses.replace(desc, buffers=(kv, dataclasses.replace(st, shape=(2, 24)))),
        dataclasses.replace(desc, tag=b""),
    ]
    for bad in changed:
        with pytest.raises(TagError, match="r~"):
            check_descriptor(bad, t, b"ticket")
    with pytest.raises(TagError):
        check_descriptor(desc, t, b"another ticket")
    for other in (PUBLIC, B):
        with pytest.raises(TagError):
            check_descriptor(desc, other.tagger(HANDOFF), b"ticket")
        with pytest.raises(TagError):  # a purpose's tag is not another's
            check_descriptor(tag_descriptor(_descriptor(), A.tagger(STORE_OBJECT), b"ticket"), t, b"ticket")


def _pair(tmp_path: Path, name: str, prefill_key: Path, decode_key: Path):  # type: ignore[no-untyped-def]
    prefill = make_engine(role="prefill", instance="p-" + name, integrity_key_file=str(prefill_key))
    decode = make_engine(role="decode", instance="d-" + name, integrity_key_file=str(decode_key))
    return prefill, decode


def _prefill(eng, r):  # type: ignore[no-untyped-def]
    eng.add_request(r, prefill_only=True)
    while eng.has_work():
        eng.step()
    return eng.pop_handoff(r.request_id)


def test_decode_refuses_a_handoff_tagged_with_another_key_or_changed_on_the_way(tmp_path: Path) -> None:
    """Real NIXL agents (both engines here): a forged offer (``forge_next_handoff``), a
    prefill of another deployment and a ticket changed on the way all fail their tag
    before anything is read; a clean handoff of the same key continues exactly."""
    key, other = _key_file(tmp_path, "a.key"), _key_file(tmp_path, "b.key")
    prefill, decode = _pair(tmp_path, "tags", key, key)
    stranger = make_engine(role="prefill", instance="p-stranger", integrity_key_file=str(other))
    tokens = prompt(70, 5)
    try:
        prefill.inject_fault("forge_next_handoff")
        r = req("f", tokens, 5)
        with pytest.raises(TagError, match="keyed tag"):
            decode.fetch_handoff(r, _prefill(prefill, r))
        r = req("s", tokens, 5)
        with pytest.raises(TagError):
            decode.fetch_handoff(r, _prefill(stranger, r))
        r = req("t", tokens, 5)
        ticket = _prefill(prefill, r)
        wrong_token = dataclasses.replace(ticket, first_token_id=ticket.first_token_id + 1)
        with pytest.raises(TagError):
            decode.fetch_handoff(r, wrong_token)
        fewer_cached = dataclasses.replace(ticket, num_cached_tokens=16)
        with pytest.raises(TagError):
            decode.fetch_handoff(r, fewer_cached)
        decode.add_handoff(r, decode.fetch_handoff(r, ticket))  # the untouched ticket continues
        rest = []
        while decode.has_work():
            rest.extend(t for o in decode.step() for t in o.new_token_ids)
        assert [ticket.first_token_id, *rest] == make_engine().generate([r])["t"]
    finally:
        prefill.close()
        decode.close()
        stranger.close()


# -- the block-hash seed -----------------------------------------------------------------------
def test_the_hash_seed_derives_from_the_key_on_our_own_hashing_only(tmp_path: Path) -> None:
    plain = load_config(env={})
    assert block_hash_seed(plain) == plain.hash_seed  # no key: the configured (public) seed
    keyed = load_config(env={}, overrides={"integrity_key_file": str(_key_file(tmp_path))})
    seed = block_hash_seed(keyed)
    assert seed != keyed.hash_seed and seed == block_hash_seed(keyed) and keyed.hash_seed not in seed
    other = load_config(env={}, overrides={"integrity_key_file": str(_key_file(tmp_path, "other"))})
    assert block_hash_seed(other) != seed
    assert block_hash_seed(keyed.model_copy(update={"hash_seed": "rotated"})) != seed
    # vLLM's NONE_HASH comes from PYTHONHASHSEED: its chain keeps hash_seed, key or not
    vllm = keyed.model_copy(update={"engine": "vllm"})
    assert block_hash_seed(vllm) == keyed.hash_seed
    eng = make_engine(integrity_key_file=keyed.integrity_key_file)
    try:
        assert eng.hasher.seed == seed
        assert eng.hasher.chain(list(prompt(32, 1))) != make_engine().hasher.chain(list(prompt(32, 1)))
    finally:
        eng.close()


def test_the_router_and_the_engines_hash_with_the_same_derived_seed(tmp_path: Path) -> None:
    """The router's lookups find what the engines publish only if both chains agree."""
    from services.router.dispatch import Dispatcher
    from services.router.metrics import RouterMetrics

    path = str(_key_file(tmp_path))
    cfg = load_config(env={}, overrides={"integrity_key_file": path})
    router = Dispatcher(cfg, None, {}, {}, RouterMetrics()).hasher
    eng = make_engine(integrity_key_file=path)
    try:
        tokens = list(prompt(64, 2))
        assert router.seed == eng.hasher.seed == block_hash_seed(cfg) != cfg.hash_seed
        assert router.chain(tokens, cache_salt="t") == eng.hasher.chain(tokens, cache_salt="t")
    finally:
        eng.close()


# -- the local stack's key and what the CLI shows ---------------------------------------------
def test_a_local_stack_writes_its_own_key_and_shared_actors_keep_the_public_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = stack_key(load_config(env={}), tmp_path)
    path = Path(cfg.integrity_key_file or "")
    assert path == tmp_path / "integrity.key" and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    first = read_key(path)
    assert read_key(stack_key(load_config(env={}), tmp_path).integrity_key_file or "") != first  # a new key per start
    given = _key_file(tmp_path, "given.key")
    assert stack_key(
        load_config(env={}, overrides={"integrity_key_file": str(given)}), tmp_path
    ).integrity_key_file == str(given)
    with caplog.at_level(logging.WARNING, logger="hybridpd.integrity"):
        shared = stack_key(load_config(env={}, overrides={"actor_placement": "worker_groups"}), tmp_path / "w")
    assert shared.integrity_key_file is None and "public key" in caplog.text
    (tmp_path / "short.key").write_text("short\n")
    with pytest.raises(ConfigError):
        stack_key(load_config(env={}, overrides={"integrity_key_file": str(tmp_path / "short.key")}), tmp_path)


def test_config_show_prints_the_key_file_never_the_key(tmp_path: Path) -> None:
    path = _key_file(tmp_path)
    out = CliRunner().invoke(cli, ["config", "show", "--integrity-key-file", str(path)])
    assert out.exit_code == 0, out.output
    assert "integrity_key_file: %s" % path in out.output
    assert read_key(path).secret.decode() not in out.output


# -- what the workers count --------------------------------------------------------------------
def test_decode_counts_a_refused_handoff_tag_apart_from_checksum_failures() -> None:
    pe, de = ToyEngine(), ToyEngine()
    cfg = load_config(env={})
    p = PrefillWorker(cfg, "prefill-0", None, None, None, engine=pe)
    d = DecodeWorker(cfg, "decode-0", engine=de)

    def forged(request, ticket):  # type: ignore[no-untyped-def]
        raise TagError("handoff %s: its keyed tag fails" % request.request_id)

    de.fetch_handoff = forged  # type: ignore[method-assign]
    try:
        r = req("r1", prompt(40, 3), 6)
        pr = p.prefill(PrefillCommand(r))
        with pytest.raises(TagError):
            list(d.generate(pr, r))
        stats = d.stats()
        assert stats["handoff_tag_failures"] == 1 and stats["checksum_failures"] == 0 and not de.seqs
    finally:
        p.close()
        d.close()


def test_prefill_counts_forged_store_objects_apart_from_corrupt_ones() -> None:
    p = PrefillWorker(load_config(env={}), "prefill-0", None, None, None, engine=ToyEngine())
    try:
        p._refused(BadObjectError("hpd/m/st/ab", TagError("forged")))
        p._refused(BadObjectError("hpd/m/kv/cd", IntegrityError("checksum mismatch")))
        assert p.stats()["store_tag_failures"] == 1
    finally:
        p.close()
