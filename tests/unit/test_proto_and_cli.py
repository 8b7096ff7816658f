"""Generated gRPC code is current; the CLI answers its documented commands."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from hybridpd import __version__
from hybridpd.protogen import ROOT, generate
from hybridpd.v1 import generate_pb2
from launch.cli import cli


def test_generated_code_is_current(tmp_path: Path) -> None:
    generate(tmp_path)
    produced = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert produced, "protoc produced nothing"
    for rel in produced:
        committed = ROOT / rel
        assert committed.exists(), "%s is not committed; run make proto" % rel
        assert committed.read_bytes() == (tmp_path / rel).read_bytes(), "%s is stale; run make proto" % rel


def test_enums_start_unspecified() -> None:
    for enum in generate_pb2.DESCRIPTOR.enum_types_by_name.values():
        assert enum.values[0].number == 0 and enum.values[0].name.endswith("_UNSPECIFIED")
    svc = generate_pb2.DESCRIPTOR.services_by_name["Generation"]
    assert svc.methods_by_name["Generate"].server_streaming
    assert not svc.methods_by_name["Abort"].server_streaming


def test_cli_version_and_help() -> None:
    runner = CliRunner()
    res = runner.invoke(cli, ["version"])
    assert res.exit_code == 0 and res.output.strip() == __version__
    res = runner.invoke(cli, ["--help"])
    assert res.exit_code == 0 and "config" in res.output and "version" in res.output
    res = runner.invoke(cli, ["config", "show", "--help"])
    assert "--prefix-match-unit" in res.output and "--eagle / --no-eagle" in res.output


def test_cli_config_show_effective(tmp_path: Path) -> None:
    runner = CliRunner()
    f = tmp_path / "c.yaml"
    f.write_text("num_decode: 2\n")
    res = runner.invoke(
        cli,
        ["config", "show", "--config", str(f), "--format", "json", "--prefix-match-unit", "32", "--eagle"],
        env={"HYBRIDPD_NUM_PREFILL": "3"},
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert (data["prefix_match_unit"], data["eagle"], data["num_prefill"], data["num_decode"]) == (32, True, 3, 2)


def test_cli_bad_value_exits_2() -> None:
    res = CliRunner().invoke(cli, ["config", "show", "--num-prefill", "0"])
    assert res.exit_code == 2
    assert "num_prefill" in res.output and "[1, 256]" in res.output


def test_console_script_installed() -> None:
    exe = Path(sys.executable).parent / "hybridpd"
    out = subprocess.run([str(exe), "version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == __version__


def test_bench_workload_overrides_are_checked() -> None:
    from click.testing import CliRunner

    from launch.cli import cli

    res = CliRunner().invoke(cli, ["bench", "growing-streams", "--workload", "bogus=3"])
    assert res.exit_code == 2 and "expected FIELD=INT" in res.output
    res = CliRunner().invoke(cli, ["bench", "growing-streams", "--workload", "start=x"])
    assert res.exit_code == 2


def test_up_refuses_a_taken_port_before_starting_anything(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A port another process listens on ends `hybridpd up` before Redis, the store or
    Ray start (e2e: test_startup_failure.py), naming the port and its flag; a free
    port is no error."""
    import socket

    from hybridpd.procs import bind_error, free_port
    from launch.stack import LocalStack

    def started(self: LocalStack) -> None:
        raise AssertionError("the stack started")

    monkeypatch.setattr(LocalStack, "start", started)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        held = holder.getsockname()[1]
        assert bind_error("127.0.0.1", held) is not None and bind_error("127.0.0.1", free_port()) is None
        ports = ["--http-port", str(free_port()), "--grpc-port", str(held)]
        res = CliRunner().invoke(cli, ["up", "--workdir", str(tmp_path), *ports])
    assert res.exit_code == 1, res.output
    assert "cannot listen on 127.0.0.1:%d (--grpc-port): address already in use" % held in res.output.lower()
