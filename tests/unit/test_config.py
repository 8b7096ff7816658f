"""Config: sources, precedence, and typed errors naming the field and range."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from hybridpd.config import HybridPDConfig, load_config
from hybridpd.errors import ConfigError


def test_defaults_validate() -> None:
    cfg = load_config(env={})
    assert cfg.prefix_match_unit == 16 and cfg.mamba_block_size == 16 and cfg.checkpoint_alignment == 16
    assert cfg.http_port == 8000 and cfg.grpc_port == 50051
    assert cfg.num_prefill == 2 and cfg.num_decode == 1


def test_precedence_yaml_env_flags(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("prefix_match_unit: 8\nmamba_block_size: 32\nnum_prefill: 3\n")
    cfg = load_config(f, env={"HYBRIDPD_NUM_PREFILL": "4", "HYBRIDPD_EAGLE": "true"}, overrides={"num_prefill": "5"})
    assert (cfg.prefix_match_unit, cfg.mamba_block_size, cfg.num_prefill, cfg.eagle) == (8, 32, 5, True)
    cfg = load_config(f, env={"HYBRIDPD_NUM_PREFILL": "4"})
    assert cfg.num_prefill == 4


def test_roundtrip_yaml(tmp_path: Path) -> None:
    cfg = load_config(env={}, overrides={"eagle": True, "checkpoint_alignment": "none", "redis_url": "redis://h:1/0"})
    assert cfg.checkpoint_alignment is None
    f = tmp_path / "c.yaml"
    f.write_text(cfg.to_yaml())
    assert load_config(f, env={}) == cfg


@pytest.mark.parametrize(
    ("overrides", "field", "fragment"),
    [
        ({"prefix_match_unit": 0}, "prefix_match_unit", "[1, 65536]"),
        ({"num_prefill": 1000}, "num_prefill", "[1, 256]"),
        ({"http_port": "http"}, "http_port", "[1, 65535]"),
        ({"dtype": "fp8"}, "dtype", "'float32', 'bfloat16'"),
        ({"hash_algo": "md5"}, "hash_algo", "sha256_cbor"),
        ({"mamba_block_size": 40}, "mamba_block_size", "multiple of prefix_match_unit"),
        ({"grpc_port": 8000}, "grpc_port", "differ"),
        ({"mooncake_master": "nohost"}, "mooncake_master", "host:port"),
        ({"redis_url": "http://x"}, "redis_url", "redis://"),
        ({"redis_cluster": True}, "redis_cluster", "needs redis_url"),
        ({"redis_cluster": True, "redis_url": "redis://h:1/2"}, "redis_cluster", "database 0 only"),
        ({"redis_cluster": True, "redis_url": "rediss://h:1/3?ssl_cert_reqs=required"}, "redis_cluster", "database 0"),
        ({"redis_read_replicas": True}, "redis_read_replicas", "needs redis_url"),
        ({"redis_read_replicas": True, "redis_url": "redis://h:1/0"}, "redis_read_replicas", "redis_replica_url"),
        (
            {"redis_read_replicas": True, "redis_url": "redis://h:1/0", "redis_replica_url": "h:2"},
            "redis_replica_url",
            "redis://",
        ),
        ({"redis_url": "redis://h:1/0", "redis_replica_url": "redis://h:2/0"}, "redis_replica_url", "with redis_read"),
        (
            {
                "redis_read_replicas": True,
                "redis_cluster": True,
                "redis_url": "redis://h:1",
                "redis_replica_url": "redis://h:2",
            },
            "redis_replica_url",
            "names its replicas",
        ),
        ({"prefill_resource": "CPU"}, "prefill_resource", "custom resource"),
        ({"decode_resource": "hybridpd_prefill"}, "decode_resource", "must differ"),
        ({"checkpoint_alignment": -4}, "checkpoint_alignment", "or null"),
    ],
)
def test_bad_values_name_field_and_range(overrides: dict[str, object], field: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides=overrides)
    assert info.value.field == field
    assert field in str(info.value) and fragment in str(info.value)


def test_unknown_yaml_key_and_bad_file(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("prefix_match_units: 8\n")
    with pytest.raises(ConfigError, match="unknown field"):
        load_config(f, env={})
    f.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(f, env={})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml", env={})


def test_env_bad_value() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={"HYBRIDPD_NUM_DECODE": "zero"})
    assert info.value.field == "num_decode"


def test_frozen() -> None:
    cfg = load_config(env={})
    with pytest.raises(ValidationError):
        cfg.http_port = 1  # type: ignore[misc]
    assert isinstance(cfg, HybridPDConfig)


def test_gpu_worker_groups_need_gpus_per_actor() -> None:
    base = {"device": "cuda", "actor_placement": "worker_groups"}
    with pytest.raises(ConfigError, match="actor_num_gpus"):
        load_config(env={}, overrides=base)
    cfg = load_config(env={}, overrides={**base, "actor_num_gpus": 1})
    assert cfg.actor_num_gpus == 1.0 and cfg.store_host == "127.0.0.1"
    assert (cfg.num_gpus("prefill"), cfg.num_gpus("decode")) == (1.0, 1.0)  # decode as prefill by default
    cfg = load_config(env={}, overrides={**base, "actor_num_gpus": 2, "decode_num_gpus": 1})
    assert (cfg.num_gpus("prefill"), cfg.num_gpus("decode")) == (2.0, 1.0)
    with pytest.raises(ConfigError, match="decode_num_gpus"):
        load_config(env={}, overrides={**base, "actor_num_gpus": 1, "decode_num_gpus": 0})


@pytest.mark.parametrize(
    ("overrides", "want"),
    [
        ({}, "float32"),  # native
        ({"engine": "vllm"}, "bfloat16"),  # vLLM's CPU GDN kernels are bf16-only
        ({"engine": "vllm", "device": "cuda"}, "auto"),  # the model's own dtype
        ({"engine": "vllm", "dtype": "float32"}, "float32"),  # explicit wins (checked against the model later)
        ({"dtype": "bfloat16"}, "bfloat16"),
    ],
)
def test_dtype_auto_resolves_per_engine(overrides: dict[str, object], want: str) -> None:
    cfg = load_config(env={}, overrides=overrides)
    assert cfg.engine_dtype() == want
    assert load_config(env={}).dtype == "auto"


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_the_native_engine_implements_eagle_only(method: str) -> None:
    """The speculative methods each engine implements are its profile's (``engine/profile.py``)."""
    with pytest.raises(ConfigError, match="the native engine implements eagle only, got '%s'" % method):
        load_config(env={}, overrides={"speculative_method": method})
    assert load_config(env={}, overrides={"engine": "vllm", "speculative_method": method}).speculative_method == method


@pytest.mark.parametrize(
    ("overrides", "split"),
    [
        ({"engine": "vllm"}, True),  # auto: vLLM on CPU, both roles on one machine
        ({"engine": "native"}, False),
        ({"engine": "vllm", "actor_placement": "worker_groups"}, False),
        ({"engine": "vllm", "device": "cuda"}, False),
        ({"engine": "native", "cpu_binding": "split"}, True),
        ({"engine": "vllm", "cpu_binding": "off"}, False),
    ],
)
def test_cpu_binding_resolves(overrides: dict[str, object], split: bool) -> None:
    assert load_config(env={}, overrides=overrides).cpu_split() is split


def test_bind_role_cpus_binds_the_thread_and_its_children() -> None:
    """Each role gets its half (procs.split_cpus); threads started afterwards inherit it;
    the caller's other threads keep theirs. Run in threads of their own: affinity is per thread."""
    import os
    import threading

    from hybridpd.procs import bind_role_cpus, split_cpus

    cpus = sorted(os.sched_getaffinity(0))
    got: dict[str, object] = {}

    def role(name: str) -> None:
        got[name] = bind_role_cpus(name)
        child: list[list[int]] = []
        t = threading.Thread(target=lambda: child.append(sorted(os.sched_getaffinity(0))))
        t.start()
        t.join()
        got[name + "_child"] = child[0]

    for name in ("prefill", "decode"):
        t = threading.Thread(target=role, args=(name,))
        t.start()
        t.join()
    assert sorted(os.sched_getaffinity(0)) == cpus
    if len(cpus) < 2:
        assert got["prefill"] is None and got["decode"] is None
        return
    prefill, decode = split_cpus(cpus)
    assert got == {"prefill": prefill, "prefill_child": prefill, "decode": decode, "decode_child": decode}


def test_a_field_the_engine_does_not_read_is_refused_not_ignored() -> None:
    from hybridpd.engine.profile import profile_of

    vllm = load_config(env={}, overrides={"engine": "vllm"})
    unread = dict(profile_of(vllm).unread_config)
    assert set(unread) == {"num_kv_blocks", "state_cache_mb", "handoff_timeout_s", "checkpoint_alignment"}
    changed = {"num_kv_blocks": 128, "state_cache_mb": 8, "handoff_timeout_s": 5, "checkpoint_alignment": 32}
    for name, value in changed.items():
        with pytest.raises(ConfigError, match="the vllm engine does not read it"):
            load_config(env={}, overrides={"engine": "vllm", name: value})
        assert getattr(load_config(env={}, overrides={name: value}), name) == value  # the native engine reads it


def test_vllms_kv_space_is_a_config_field_the_native_engine_refuses() -> None:
    """#53: vLLM's KV and state space comes from the config (its default is the vLLM
    engine's ``DEFAULT_KV_CACHE_BYTES``), is validated like every field, and is
    refused, not ignored, by the native engine (its profile's ``unread_config``)."""
    from hybridpd.engine.profile import profile_of
    from hybridpd.engine.vllm.environment import DEFAULT_KV_CACHE_BYTES

    cfg = load_config(env={}, overrides={"engine": "vllm"})
    assert cfg.vllm_kv_cache_memory_bytes == DEFAULT_KV_CACHE_BYTES and cfg.vllm_kv_cache_blocks is None
    env = {"HYBRIDPD_VLLM_KV_CACHE_MEMORY_BYTES": str(3 << 29), "HYBRIDPD_VLLM_KV_CACHE_BLOCKS": "40"}
    cfg = load_config(env=env, overrides={"engine": "vllm"})
    assert (cfg.vllm_kv_cache_memory_bytes, cfg.vllm_kv_cache_blocks) == (3 << 29, 40)
    by_bytes = load_config(env={}, overrides={"engine": "vllm", "vllm_kv_cache_blocks": "none"})
    assert by_bytes.vllm_kv_cache_blocks is None
    for name, bad in (("vllm_kv_cache_memory_bytes", 0), ("vllm_kv_cache_blocks", 0), ("vllm_kv_cache_blocks", "x")):
        with pytest.raises(ConfigError, match=name):
            load_config(env={}, overrides={"engine": "vllm", name: bad})
    native = dict(profile_of(load_config(env={})).unread_config)
    assert set(native) == {"vllm_kv_cache_memory_bytes", "vllm_kv_cache_blocks"}
    for name, value in (("vllm_kv_cache_memory_bytes", 2 << 30), ("vllm_kv_cache_blocks", 40)):
        with pytest.raises(ConfigError, match="the native engine does not read it"):
            load_config(env={}, overrides={name: value})
    assert load_config(env={}, overrides={"vllm_kv_cache_memory_bytes": DEFAULT_KV_CACHE_BYTES})  # the default passes
