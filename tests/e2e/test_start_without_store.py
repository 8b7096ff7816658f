"""Start-up survives the Mooncake master being down (issue #51): `hybridpd up` with an
unreachable --mooncake-master serves (every prompt recomputed, exact tokens), and
once a master listens there the prefill actors connect and store hits come back,
without a restart."""

from __future__ import annotations

from pathlib import Path

from openai import OpenAI

from hybridpd.procs import listen_ports
from hybridpd.store.master import MooncakeMaster
from tests.e2e.conftest import Stack
from tests.unit.engine_helpers import prompt
from tests.wait import Pending, wait_until


def test_serves_without_the_store_and_attaches_when_it_returns(tmp_path: Path, reference) -> None:  # type: ignore[no-untyped-def]
    run, _ = reference
    rpc, meta = listen_ports(2)
    args = ["--mooncake-master", "127.0.0.1:%d" % rpc, "--mooncake-metadata-url", "http://127.0.0.1:%d/metadata" % meta]
    stack = Stack(tmp_path / "stack", [*args, "--num-prefill", "1"])
    stack.start()
    master = None
    try:
        log = stack.log.read_text(errors="replace")
        assert "Mooncake master" in log and "not reachable" in log
        client = OpenAI(base_url=stack.http + "/v1", api_key="unused", max_retries=0)

        def complete(toks: list[int]):  # type: ignore[no-untyped-def]
            return client.completions.create(
                model="tiny", prompt=toks, max_tokens=4, temperature=0, extra_body={"return_token_ids": True}
            )

        tokens = list(prompt(200, 94))
        assert complete(tokens).choices[0].token_ids == run(tokens, 4)  # type: ignore[attr-defined]
        (tmp_path / "master").mkdir()
        master = MooncakeMaster(tmp_path / "master", rpc_port=rpc, metadata_port=meta)
        master.start()

        seeds = iter(range(100, 10**6))
        sent: list[list[int]] = []

        def stored() -> int | Pending:  # the actor tries its master again within RECONNECT_S
            sent.append(list(prompt(200, next(seeds))))  # a new prompt: a new checkpoint to put
            complete(sent[-1])
            got = stack.lookup(sent[-1]).store_hit
            return got if got > 0 else Pending(got)

        wait_until(stored, 90, 1.0, "a store hit once the master is back")
        ext = [*sent[-1], *prompt(20, 96)]
        again = complete(ext)
        assert again.choices[0].token_ids == run(ext, 4)  # type: ignore[attr-defined]
    finally:
        stack.stop()
        if master is not None:
            master.stop()
