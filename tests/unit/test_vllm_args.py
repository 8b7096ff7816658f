"""Our config -> vLLM EngineArgs keyword arguments (no vLLM needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridpd.config import load_config
from hybridpd.engine.vllm.args import engine_kwargs, kv_transfer_config, mooncake_config
from hybridpd.errors import ConfigError

MODEL = Path("/models/qwen3-next")


def _cfg(**kw: object):  # type: ignore[no-untyped-def]
    return load_config(env={}, overrides={"engine": "vllm", **kw})


def test_caching_and_hybrid_settings_map_onto_vllm() -> None:
    kw = engine_kwargs(
        _cfg(prefix_match_unit=128, mamba_block_size=1024, hash_algo="xxhash_cbor", dtype="bfloat16"), MODEL, "local"
    )
    assert kw["model"] == str(MODEL) and kw["dtype"] == "bfloat16"
    assert kw["enable_prefix_caching"] is True and kw["mamba_cache_mode"] == "align"
    assert kw["prefix_match_unit"] == 128 and kw["prefix_caching_hash_algo"] == "xxhash_cbor"
    assert kw["prefix_cache_retention_interval"] == 0  # vLLM's default, chosen (bench vllm-retention)
    assert engine_kwargs(_cfg(vllm_retention_interval=768), MODEL, "local")["prefix_cache_retention_interval"] == 768
    assert "kv_transfer_config" not in kw and "speculative_config" not in kw
    off = engine_kwargs(_cfg(enable_prefix_caching=False), MODEL, "local")
    assert off["enable_prefix_caching"] is False and "mamba_cache_mode" not in off


def test_the_kv_space_comes_from_the_config() -> None:
    """vLLM's KV and state space: ``vllm_kv_cache_memory_bytes`` always, plus a page
    count where ``vllm_kv_cache_blocks`` is set (no environment variable is read)."""
    kw = engine_kwargs(_cfg(), MODEL, "prefill")
    assert kw["kv_cache_memory_bytes"] == 1 << 30 and "num_gpu_blocks_override" not in kw
    kw = engine_kwargs(_cfg(vllm_kv_cache_memory_bytes=3 << 29, vllm_kv_cache_blocks=40), MODEL, "decode")
    assert kw["kv_cache_memory_bytes"] == 3 << 29 and kw["num_gpu_blocks_override"] == 40


def test_roles_get_nixl_producer_consumer_and_store() -> None:
    cfg = _cfg()
    assert kv_transfer_config(cfg, "local") is None
    assert kv_transfer_config(cfg, "prefill") == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer",
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "recompute",  # a failing cache path degrades to recompute
    }
    assert kv_transfer_config(_cfg(device="cuda"), "decode")["kv_buffer_device"] == "cuda"  # type: ignore[index]
    multi = kv_transfer_config(cfg, "prefill", store=True)
    assert multi is not None and multi["kv_connector"] == "MultiConnector"
    assert multi["kv_load_failure_policy"] == "recompute"
    names = [c["kv_connector"] for c in multi["kv_connector_extra_config"]["connectors"]]
    assert names == ["NixlConnector", "MooncakeStoreConnector"]
    assert kv_transfer_config(cfg, "decode", store=True)["kv_connector"] == "NixlConnector"  # type: ignore[index]
    mc = mooncake_config("10.0.0.1:50061", "http://10.0.0.1:8080/metadata")
    assert mc["master_server_address"] == "10.0.0.1:50061" and mc["protocol"] == "tcp"


def test_vllm_store_switch_keeps_the_store_from_vllm_prefill_engines_only() -> None:
    """``--no-vllm-store``: a vLLM prefill engine gets no store (plain NixlConnector);
    the native engine keeps its store whatever the switch says."""
    from services.prefill.actor import engine_store

    store = ("127.0.0.1:50051", "http://127.0.0.1:8080/metadata")
    assert engine_store(_cfg(), store) == store  # on by default
    assert engine_store(_cfg(vllm_store=False), store) is None
    native = load_config(env={}, overrides={"engine": "native", "vllm_store": False})
    assert engine_store(native, store) == store
    assert engine_store(_cfg(), None) is None


def test_eagle_on_decode_needs_a_draft(tmp_path: Path) -> None:
    cfg = _cfg(eagle=True, num_speculative_tokens=4)
    with pytest.raises(ConfigError, match="EAGLE draft"):
        engine_kwargs(cfg, tmp_path, "decode")
    (tmp_path / "eagle").mkdir()
    spec = engine_kwargs(cfg, tmp_path, "decode")["speculative_config"]
    assert spec == {"method": "eagle", "model": str(tmp_path / "eagle"), "num_speculative_tokens": 4}
    assert "speculative_config" not in engine_kwargs(cfg, tmp_path, "prefill")


def test_kv_events_and_unknown_role() -> None:
    kw = engine_kwargs(_cfg(), MODEL, "prefill", kv_events_endpoint="ipc:///tmp/x.sock")
    assert kw["kv_events_config"]["endpoint"] == "ipc:///tmp/x.sock"
    assert kw["kv_events_config"]["enable_kv_cache_events"] is True
    with pytest.raises(ConfigError):
        engine_kwargs(_cfg(), MODEL, "both")  # type: ignore[arg-type]


def test_eagle3_and_mtp(tmp_path: Path) -> None:
    mtp = engine_kwargs(_cfg(eagle=True, speculative_method="mtp"), tmp_path, "decode")["speculative_config"]
    assert mtp == {"method": "mtp", "num_speculative_tokens": 3}
    with pytest.raises(ConfigError, match="EAGLE3 draft"):
        engine_kwargs(_cfg(eagle=True, speculative_method="eagle3"), tmp_path, "decode")
    (tmp_path / "eagle3").mkdir()
    e3 = engine_kwargs(_cfg(eagle=True, speculative_method="eagle3"), tmp_path, "decode")["speculative_config"]
    assert e3["method"] == "eagle3" and e3["model"] == str(tmp_path / "eagle3")
    with pytest.raises(ConfigError, match="eagle only"):
        load_config(env={}, overrides={"speculative_method": "mtp"})


def _model_dir(tmp_path: Path, arch: str) -> Path:
    (tmp_path / "config.json").write_text('{"architectures": ["%s"], "model_type": "x"}' % arch)
    return tmp_path


def test_cpu_float32_is_refused_for_gdn_models_naming_dtype(tmp_path: Path) -> None:
    from hybridpd.engine.vllm.args import check_dtype

    gdn = _model_dir(tmp_path, "Qwen3NextForCausalLM")
    with pytest.raises(ConfigError, match="dtype") as err:
        check_dtype(_cfg(dtype="float32"), gdn)
    assert err.value.field == "dtype"
    check_dtype(_cfg(), gdn)  # auto: bfloat16 on CPU
    check_dtype(_cfg(dtype="bfloat16"), gdn)
    check_dtype(_cfg(dtype="float32", device="cuda"), gdn)
    (tmp_path / "dense").mkdir()
    check_dtype(_cfg(dtype="float32"), _model_dir(tmp_path / "dense", "LlamaForCausalLM"))
    check_dtype(_cfg(dtype="float32"), "org/some-hf-id")  # not a local directory: not checked here
    assert engine_kwargs(_cfg(), MODEL, "prefill")["dtype"] == "bfloat16"
