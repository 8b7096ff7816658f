"""Two Ray nodes started the way an operator starts them (``ray start --head``
and ``ray start --address=...``, each with its own custom resource), and
``hybridpd up --ray-address`` placing prefill actors on one and decode actors
on the other by those resources (``--prefill-resource`` / ``--decode-resource``,
the Helm chart's ``ray.<group>.resource``). P/D crosses the nodes over NIXL;
outputs equal the monolithic reference, as the one-node stack's do."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from openai import OpenAI

from hybridpd.procs import free_port
from tests.e2e.conftest import Stack
from tests.unit.engine_helpers import prompt

pytestmark = pytest.mark.e2e

PREFILL_RESOURCE, DECODE_RESOURCE = "pool_a_prefill", "pool_a_decode"


class TwoNodes:
    """A head node offering the prefill resource and a worker node offering the decode one."""

    def __init__(self) -> None:
        # NOTE: a short temp dir: Ray's unix socket paths live under it (about 107 bytes at most)
        self.temp_dir = tempfile.mkdtemp(prefix="hpdray", dir="/tmp")
        self.port = free_port()
        self.address = "127.0.0.1:%d" % self.port
        self.ray = str(Path(sys.executable).parent / "ray")
        # token auth, as the chart runs Ray: a node joins only with the head's token (~/.ray/auth_token)
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}

    def _ray(self, *args: str) -> None:
        subprocess.run([self.ray, *args], check=True, env=self.env, timeout=180, capture_output=True)

    def start(self) -> None:
        common = ["--num-cpus", "1", "--disable-usage-stats"]
        self._ray(
            "start",
            "--head",
            "--port",
            str(self.port),
            "--temp-dir",
            self.temp_dir,
            "--include-dashboard",
            "false",
            "--resources",
            json.dumps({PREFILL_RESOURCE: 2}),
            *common,
        )
        self._ray("start", "--address", self.address, "--resources", json.dumps({DECODE_RESOURCE: 1}), *common)

    def node_ids(self) -> dict[str, str]:
        """Resource name -> the id of the node that offers it (asked from a separate driver)."""
        code = (
            "import json, ray; ray.init(address=%r, logging_level='ERROR');"
            "print(json.dumps({r: n['NodeID'] for n in ray.nodes() if n['Alive'] for r in n['Resources']}))"
            % self.address
        )
        out = subprocess.run([sys.executable, "-c", code], env=self.env, check=True, capture_output=True, timeout=120)
        return dict(json.loads(out.stdout.decode().strip().splitlines()[-1]))

    def stop(self) -> None:
        """Kill this cluster's processes only (``ray stop`` would end every Ray on the machine)."""
        mark = re.compile(r"%s|[:=]%d(?!\d)" % (re.escape(self.temp_dir), self.port))
        doomed: list[psutil.Process] = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                if mark.search(" ".join(p.info["cmdline"] or [])):
                    doomed += [p, *p.children(recursive=True)]
            except psutil.Error:
                continue
        for p in doomed:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(doomed, timeout=10)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        # NOTE: a plain ray.init() (hybridpd up without --ray-address) joins the cluster this file
        # names: one left behind by a killed cluster would make every later stack fail to start
        for current in (Path("/tmp/ray/ray_current_cluster"), Path(self.temp_dir) / "ray_current_cluster"):
            try:
                if current.read_text().strip().endswith(":%d" % self.port):
                    current.unlink()
            except OSError:
                pass


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, TwoNodes]]:
    nodes = TwoNodes()
    try:
        nodes.start()
        args = [
            "--ray-address",
            nodes.address,
            "--actor-placement",
            "worker_groups",
            "--prefill-resource",
            PREFILL_RESOURCE,
            "--decode-resource",
            DECODE_RESOURCE,
        ]
        s = Stack(Path(tmp_path_factory.mktemp("twonodes")), args, env={"RAY_AUTH_MODE": "token"})
        s.start()
        try:
            yield s, nodes
        finally:
            s.stop()
    finally:
        nodes.stop()


def test_prefill_and_decode_actors_sit_on_their_nodes_and_outputs_are_exact(two_nodes, reference) -> None:  # type: ignore[no-untyped-def]
    stack, nodes = two_nodes
    run, _ = reference
    ids = nodes.node_ids()
    assert ids[PREFILL_RESOURCE] != ids[DECODE_RESOURCE]
    client = OpenAI(base_url=stack.http + "/v1", api_key="unused", max_retries=0)
    for seed in (101, 102, 103):
        tokens = list(prompt(180, seed))
        got = client.completions.create(
            model="tiny", prompt=tokens, max_tokens=8, temperature=0, extra_body={"return_token_ids": True}
        )
        assert got.choices[0].token_ids == run(tokens, 8)  # type: ignore[attr-defined]
    stats = stack.stats()
    assert {n: s["ray_node_id"] for n, s in stats.items()} == {
        "prefill-0": ids[PREFILL_RESOURCE],
        "prefill-1": ids[PREFILL_RESOURCE],
        "decode-0": ids[DECODE_RESOURCE],
    }
    decode = stats["decode-0"]
    assert decode["decode_handoffs"] >= 3 and decode["nixl_read_bytes"] > 0  # P/D across the nodes, over NIXL
