"""Our config -> vLLM ``EngineArgs`` keyword arguments (vLLM 0.32).

Pure data: importing this module does not import vLLM. One mapping for the
three roles an engine can play:

* ``local``: one engine does prefill and decode (tests, ``vllm-direct``);
* ``prefill``: NixlConnector ``kv_producer`` (decode pulls the KV and state);
* ``decode``: NixlConnector ``kv_consumer``, plus speculative decoding when
  ``eagle`` is on.

With a store (a Mooncake master) the prefill side gets a MultiConnector:
NixlConnector for the handoff, MooncakeStoreConnector for the shared prefix
store (vLLM reads the store's address from the JSON file named by
``MOONCAKE_CONFIG_PATH``: see :func:`mooncake_config`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from hybridpd.config import HybridPDConfig
from hybridpd.errors import ConfigError

Role = Literal["local", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("local", "prefill", "decode")


def _nixl(role: str, device: str) -> dict[str, Any]:
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu" if device == "cpu" else "cuda"}


#: a failed KV load (store miss, NIXL read error) recomputes instead of failing the request
LOAD_FAILURE_POLICY = {"kv_load_failure_policy": "recompute"}


def mooncake_config(master: str, metadata_url: str, segment_bytes: int = 256 << 20) -> dict[str, Any]:
    """The MooncakeStoreConnector's config file (``MOONCAKE_CONFIG_PATH``) for one engine."""
    return {
        "metadata_server": metadata_url,
        "master_server_address": master,
        "protocol": "tcp",
        "device_name": "",
        "global_segment_size": segment_bytes,
        "local_buffer_size": 64 << 20,
    }


def kv_transfer_config(cfg: HybridPDConfig, role: Role, store: bool = False) -> dict[str, Any] | None:
    """The ``kv_transfer_config`` of an engine in ``role`` (None for ``local``);
    ``store``: a prefill engine also saves to / loads from MooncakeStore."""
    if role == "local":
        return None
    nixl = _nixl("kv_producer" if role == "prefill" else "kv_consumer", cfg.device)
    if role == "prefill" and store:
        mooncake = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
        return {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [nixl, mooncake]},
            **LOAD_FAILURE_POLICY,
        }
    return {**nixl, **LOAD_FAILURE_POLICY}


def speculative_config(cfg: HybridPDConfig, role: Role, model_dir: Path) -> dict[str, Any] | None:
    """Speculative decoding on decode (and on a local engine) when ``eagle`` is on:
    EAGLE / EAGLE3 with the draft at ``<model>/eagle`` (or ``<model>/eagle3``), or
    MTP with the model's own multi-token-prediction layers."""
    if not cfg.eagle or role == "prefill":
        return None
    if cfg.speculative_method == "mtp":
        return {"method": "mtp", "num_speculative_tokens": cfg.num_speculative_tokens}
    draft = model_dir / cfg.speculative_method
    if not draft.exists():
        raise ConfigError("eagle", "engine vllm needs a %s draft model at %s" % (cfg.speculative_method.upper(), draft))
    return {"method": cfg.speculative_method, "model": str(draft), "num_speculative_tokens": cfg.num_speculative_tokens}


#: architectures built on vLLM's gated-delta-net layer (qwen_gdn_linear_attn), whose CPU kernel is bf16-only
GDN_ARCHITECTURES = ("Qwen3Next", "Qwen3_5", "OlmoHybrid", "InternS2Mobius")


def check_dtype(cfg: HybridPDConfig, model: Path | str) -> None:
    """Refuse float32 for a GDN model on CPU: vLLM's CPU GDN kernel asserts bfloat16
    on every request ("CPU GDN attention requires BF16"), so such an engine would start
    and then fail every request. ``model``: a local directory (an HF id is not checked)."""
    if cfg.device != "cpu" or cfg.engine_dtype() != "float32":
        return
    try:
        hf = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return  # not a local model directory (or no readable config): vLLM's own checks apply
    archs = [a for a in hf.get("architectures") or () if isinstance(a, str) and a.startswith(GDN_ARCHITECTURES)]
    if archs:
        raise ConfigError(
            "dtype",
            "vLLM on CPU runs the gated-delta-net layers of %s (%s) in bfloat16 only, got float32;"
            " use bfloat16 or auto (the default)" % (model, archs[0]),
        )


def engine_kwargs(
    cfg: HybridPDConfig,
    model_dir: Path,
    role: Role,
    *,
    kv_events_endpoint: str | None = None,
    kv_cache_memory_bytes: int | None = None,
    store: bool = False,
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.engine.arg_utils.EngineArgs``.

    ``kv_events_endpoint`` (e.g. ``tcp://127.0.0.1:5557``) turns on vLLM's ZMQ
    KV-cache events, which ``hybridpd.engine.vllm.kv_events`` mirrors into the
    prefix index.
    """
    if role not in ROLES:
        raise ConfigError("engine", "unknown vLLM engine role %r" % role)
    kw: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": cfg.engine_dtype(),
        "max_model_len": cfg.max_model_len,
        "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": max(cfg.max_num_batched_tokens, cfg.max_model_len),
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "prefix_caching_hash_algo": str(cfg.hash_algo.value),
        "seed": 0,
        "enforce_eager": cfg.device == "cpu",
    }
    if cfg.enable_prefix_caching:
        # hybrid models: cache the recurrent state at block boundaries ("align"), and
        # at prefix_match_unit granularity within them (partial-prefix checkpoints)
        kw["mamba_cache_mode"] = "align"
        kw["prefix_match_unit"] = cfg.prefix_match_unit
    if kv_cache_memory_bytes is not None:
        kw["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    transfer = kv_transfer_config(cfg, role, store)
    if transfer is not None:
        kw["kv_transfer_config"] = transfer
    spec = speculative_config(cfg, role, model_dir)
    if spec is not None:
        kw["speculative_config"] = spec
    if kv_events_endpoint is not None:
        kw["kv_events_config"] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": kv_events_endpoint,
            "topic": "kv",
        }
    return kw
