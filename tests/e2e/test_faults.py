"""Faults on a real stack: outputs stay correct, failures are clean, the
state plane recovers. This module runs its own stack (it breaks things)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from openai import OpenAI

from hybridpd.config import load_config
from hybridpd.engine.profile import profile_of
from hybridpd.errors import UnavailableError
from hybridpd.index.prefix_index import PrefixIndex
from hybridpd.index.redis_server import redis_server_binary
from hybridpd.integrity import PUBLIC, STORE_OBJECT, read_key
from hybridpd.procs import port_open
from hybridpd.store import objects
from hybridpd.store.client import CheckpointStore
from tests.e2e.conftest import Stack
from tests.unit.engine_helpers import prompt
from tests.wait import Pending, wait_until

HANDOFF_TIMEOUT_S = 5


@pytest.fixture(scope="module")
def fstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # NOTE: placement off: the repair test pins which store entries a prompt leaves
    args = ["--fault-injection", "--handoff-timeout-s", str(HANDOFF_TIMEOUT_S), "--checkpoint-placement", "off"]
    s = Stack(Path(tmp_path_factory.mktemp("faults")), args)
    s.start()
    try:
        yield s
    finally:
        s.stop()


def _client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=stack.http + "/v1", api_key="unused", max_retries=0)


def _complete(stack: Stack, tokens: list[int], max_tokens: int = 6, **extra: object):  # type: ignore[no-untyped-def]
    return _client(stack).completions.create(
        model="tiny",
        prompt=tokens,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"return_token_ids": True, **extra},
    )


def _metric(stack: Stack, name: str) -> float:
    total = 0.0
    for line in httpx.get(stack.http + "/metrics").text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _pid_listening(port: int) -> int:
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            return c.pid
    raise AssertionError("nothing listens on %d" % port)


def test_corrupted_handoff_is_detected_and_redone(fstack: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    run, _ = reference
    tokens = list(prompt(150, 61))
    r = httpx.post(fstack.http + "/v1/hybridpd/faults", json={"corrupt_next_handoff": "prefill-0"})
    assert r.status_code == 200
    before = _metric(fstack, 'hybridpd_retries_total{kind="handoff"}')
    got = _complete(fstack, tokens, hybridpd_prefill_instance="prefill-0")
    assert got.choices[0].token_ids == run(tokens, 6)  # type: ignore[attr-defined]
    assert _metric(fstack, 'hybridpd_retries_total{kind="handoff"}') == before + 1


def _prefill_stats(stack: Stack, key: str) -> dict[str, float]:
    return {name: s[key] for name, s in stack.stats().items() if name.startswith("prefill-")}


def test_a_handoff_not_tagged_with_the_key_is_refused_and_redone(fstack: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    """prefill-0 tags its next offer with a key no deployment holds: decode refuses it
    before reading (TagError, counted apart from checksum failures), the router
    prefills again on the other instance, and the output is exact."""
    run, _ = reference
    tokens = list(prompt(150, 71))
    tags = fstack.stats()["decode-0"]["handoff_tag_failures"]
    checksums = fstack.stats()["decode-0"]["checksum_failures"]
    retries = _metric(fstack, 'hybridpd_retries_total{kind="handoff"}')
    r = httpx.post(fstack.http + "/v1/hybridpd/faults", json={"forge_next_handoff": "prefill-0"})
    assert r.status_code == 200, r.text
    got = _complete(fstack, tokens, hybridpd_prefill_instance="prefill-0")
    assert got.choices[0].token_ids == run(tokens, 6)  # type: ignore[attr-defined]
    assert _metric(fstack, 'hybridpd_retries_total{kind="handoff"}') == retries + 1
    decode = fstack.stats()["decode-0"]
    assert decode["handoff_tag_failures"] == tags + 1 and decode["checksum_failures"] == checksums


def test_a_forged_store_object_is_refused_deleted_and_recomputed(fstack: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    """A peer that reaches the store but not the key overwrites a prompt's state object
    with a changed state and a valid checksum (tagged with the public key): the next
    prefill refuses it (nothing restored, counted), deletes it, and the output is exact."""
    run, _ = reference
    u = load_config(env={}).prefix_match_unit
    model_id = fstack.stats()["prefill-0"]["model_id"]
    base = list(prompt(300, 72))
    ext = base + list(prompt(40, 73))
    _complete(fstack, base, hybridpd_prefill_instance="prefill-0")
    pos = fstack.wait_store_hit(ext, timeout_s=20)
    (key_file,) = fstack.key_args()[1:]
    master = (fstack.banner("Mooncake master"), fstack.banner("Mooncake metadata"))
    store = CheckpointStore(*master, model_id, segment_bytes=16 << 20, key=read_key(key_file))
    try:
        name = store.key("st", fstack.hasher.chain(base)[pos // u - 1])
        ((hdr, bufs),) = store.get_objects([name], "state")  # the real one passes with the stack's key
        forged = [b.clone() for b in bufs]
        forged[0].view(-1)[:64] += 1.0  # a state that would steer the continuation
        parts = objects.encode(model_id, "state", hdr.position, forged, name=name, tagger=PUBLIC.tagger(STORE_OBJECT))
        assert store.remove([name]) == []
        assert store.store.put_parts(name, *parts) == 0
        failures = _prefill_stats(fstack, "prefill_store_load_failures")["prefill-1"]
        tags = _prefill_stats(fstack, "store_tag_failures")["prefill-1"]
        got = _complete(fstack, ext, hybridpd_prefill_instance="prefill-1")
        assert got.choices[0].token_ids == run(ext, 6)  # type: ignore[attr-defined]
        assert got.usage.prompt_tokens_details.cached_tokens == 0  # nothing restored from the forgery
        assert _prefill_stats(fstack, "prefill_store_load_failures")["prefill-1"] == failures + 1
        assert _prefill_stats(fstack, "store_tag_failures")["prefill-1"] == tags + 1
        assert store.exists([name]) == [False] or store.get_objects([name], "state")[0][0].position == pos
    finally:
        store.close()


def test_decode_too_late_prefill_frees_and_request_is_redone(fstack: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    run, _ = reference
    tokens = list(prompt(140, 67))
    expired_before = _prefill_stats(fstack, "handoffs_expired")
    retries_before = _metric(fstack, 'hybridpd_retries_total{kind="handoff"}')
    r = httpx.post(fstack.http + "/v1/hybridpd/faults", json={"delay_next_handoff_read": "decode-0"})
    assert r.status_code == 200, r.text
    t0 = time.monotonic()
    got = _complete(fstack, tokens, hybridpd_prefill_instance="prefill-0")
    assert time.monotonic() - t0 > HANDOFF_TIMEOUT_S  # decode really arrived after the timeout
    assert got.choices[0].token_ids == run(tokens, 6)  # type: ignore[attr-defined]
    # decode's late read failed cleanly: the router prefilled again (on the other instance)
    assert _metric(fstack, 'hybridpd_retries_total{kind="handoff"}') == retries_before + 1
    # and prefill-0 freed the unread handoff on its timeout
    wait_until(
        lambda: _prefill_stats(fstack, "handoffs_expired")["prefill-0"] >= expired_before["prefill-0"] + 1,
        10,
        0.2,
        "prefill-0 to expire the unread handoff",
    )
    stats = fstack.wait_all_free()
    assert all(s.get("handoffs_outstanding", 0) == 0 for s in stats.values())


def test_store_objects_deleted_behind_the_index(fstack: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    run, _ = reference
    cfg = load_config(env={})  # the stack runs on the defaults
    hasher = fstack.hasher  # seeded from the stack's integrity key
    model_id = fstack.stats()["prefill-0"]["model_id"]
    index = PrefixIndex(fstack.banner("Redis (prefix index)"), model_id)
    base = list(prompt(300, 68))
    ext = base + list(prompt(40, 69))
    exports = _prefill_stats(fstack, "checkpoint_exports")["prefill-0"]
    _complete(fstack, base, hybridpd_prefill_instance="prefill-0")
    fstack.wait_store_hit(ext, timeout_s=20)  # put in the store and published asynchronously
    assert _prefill_stats(fstack, "checkpoint_exports")["prefill-0"] > exports
    # every state object of this model disappears behind the index's back
    store = CheckpointStore(
        fstack.banner("Mooncake master"), fstack.banner("Mooncake metadata"), model_id, segment_bytes=16 << 20
    )
    try:
        assert store.store.remove_by_regex("^hpd/%s/st/" % re.escape(model_id), True) > 0
    finally:
        store.close()
    failures = _prefill_stats(fstack, "prefill_store_load_failures")["prefill-1"]
    got = _complete(fstack, ext, hybridpd_prefill_instance="prefill-1")
    assert got.choices[0].token_ids == run(ext, 6)  # type: ignore[attr-defined]
    assert got.usage.prompt_tokens_details.cached_tokens == 0  # recomputed, nothing wrong restored
    assert _prefill_stats(fstack, "prefill_store_load_failures")["prefill-1"] == failures + 1
    # the index was repaired: the dead entry no longer promises a store hit
    # (prefill-1 published its own checkpoint for ext, which ends later than base's)
    drop = profile_of(cfg).eagle_drop_prefill
    hit = index.lookup(hasher.chain(base), len(base), cfg.prefix_match_unit, drop).store_hit
    assert hit == 0 or hit > len(base) - cfg.prefix_match_unit - 1, hit


def test_redis_down_serves_then_recovers(fstack: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    run, _ = reference
    url = fstack.banner("Redis (prefix index)")
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    os.kill(_pid_listening(port), signal.SIGKILL)
    wait_until(lambda: not port_open("127.0.0.1", port), 10, what="the killed Redis to stop listening")
    before = _metric(fstack, 'hybridpd_routing_decisions_total{decision="index_unavailable"}')
    tokens = list(prompt(300, 62))
    got = _complete(fstack, tokens)
    assert got.choices[0].token_ids == run(tokens, 6)  # type: ignore[attr-defined]
    assert _metric(fstack, 'hybridpd_routing_decisions_total{decision="index_unavailable"}') == before + 1
    assert "prefix index unavailable" in fstack.log.read_text(errors="replace")
    # Redis comes back (empty: persistence is off); hits return for new checkpoints
    redis = subprocess.Popen(
        [redis_server_binary(), "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: port_open("127.0.0.1", port), 10, 0.1, "Redis to listen again")
        wait_until(  # heartbeats re-register the instances
            lambda: {"prefill-0", "prefill-1"} <= set(fstack.index.live_instances()),
            10,
            0.1,
            "both prefill instances' heartbeats in the new Redis",
            retry_on=(UnavailableError,),
        )
        base = list(prompt(300, 63))
        _complete(fstack, base, hybridpd_prefill_instance="prefill-1")
        tokens = base + list(prompt(40, 64))
        fstack.wait_store_hit(tokens)  # prefill-1's checkpoint published in the new Redis
        ext = _complete(fstack, tokens, hybridpd_prefill_instance="prefill-0")
        assert ext.usage.prompt_tokens_details.cached_tokens > 0  # loaded via the store, found via Redis
        assert ext.choices[0].token_ids == run(tokens, 6)  # type: ignore[attr-defined]
    finally:
        redis.terminate()
        redis.wait(10)


def test_mooncake_down_recomputes(fstack: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    run, _ = reference
    master = fstack.banner("Mooncake master")
    host, _, port = master.rpartition(":")
    os.kill(_pid_listening(int(port)), signal.SIGKILL)
    wait_until(lambda: not port_open(host, int(port)), 10, what="the killed Mooncake master to stop listening")
    base = list(prompt(260, 65))
    _complete(fstack, base, hybridpd_prefill_instance="prefill-0")
    ext = base + list(prompt(30, 66))
    got = _complete(fstack, ext, hybridpd_prefill_instance="prefill-1")
    assert got.choices[0].token_ids == run(ext, 6)  # type: ignore[attr-defined]


def test_prefill_actor_killed_mid_prefill_is_retried(fstack: Stack, reference) -> None:  # type: ignore[no-untyped-def]
    run, _ = reference
    pid = httpx.get(fstack.http + "/v1/hybridpd/stats", timeout=30).json()["prefill-0"]["pid"]
    tokens = list(prompt(12000, 67))  # a window the stats poll catches on a loaded machine too
    result: dict = {}

    def call() -> None:
        try:
            result["resp"] = _complete(fstack, tokens, 4, hybridpd_prefill_instance="prefill-0")
        except Exception as exc:  # the assertion below reports it
            result["exc"] = exc

    t = threading.Thread(target=call)
    t.start()
    wait_until(  # prefill-0 is busy with the 12,000-token prompt (512 tokens a step: two dozen steps)
        lambda: fstack.stats()["prefill-0"]["pool"]["num_running"] > 0, 60, 0.05, "prefill-0 to run the prompt"
    )
    os.kill(pid, signal.SIGKILL)
    t.join(300)
    assert "exc" not in result, result.get("exc")
    assert result["resp"].choices[0].token_ids == run(tokens, 4)
    assert _metric(fstack, 'hybridpd_retries_total{kind="prefill"}') >= 1


def test_decode_killed_mid_stream_is_a_clean_error(fstack: Stack) -> None:
    """Chosen behaviour: tokens already streamed cannot be taken back, so the
    stream ends with an error event and no [DONE]; never a cut stream that looks
    finished. (Ray restarts the actor for later requests.)"""
    pid = httpx.get(fstack.http + "/v1/hybridpd/stats", timeout=30).json()["decode-0"]["pid"]
    body = {
        "model": "tiny",
        "prompt": list(prompt(100, 68)),
        "max_tokens": 5000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    lines = []
    with httpx.stream("POST", fstack.http + "/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line:
                lines.append(line)
            if len(lines) == 5:
                os.kill(pid, signal.SIGKILL)
    assert lines[-1] != "data: [DONE]"
    err = json.loads(lines[-1].removeprefix("data: "))["error"]
    assert err["code"] == 503 and err["type"] == "UnavailableError"
    # the client learns the request's id, not Ray's or the engine's text: that is the log's
    rid = err["message"].rsplit("(request ", 1)[1].rstrip(")")
    assert err["message"].startswith("no instance could serve the request") and "Ray" not in err["message"]
    assert any(rid in line and "decode of" in line for line in fstack.log.read_text(errors="replace").splitlines())

    def ready() -> bool | Pending:  # readiness comes back once Ray restarted the decode actor
        r = httpx.get(fstack.http + "/ready", timeout=30)
        return True if r.status_code == 200 else Pending(r.text)

    wait_until(ready, 120, 0.5, "the router ready again")
    assert not any('"finish_reason": "length"' in x for x in lines)
