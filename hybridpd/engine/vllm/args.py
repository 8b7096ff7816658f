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

Under ``checkpoint_policy: branch-aware`` an engine also gets vLLM's own
junction checkpoints (``enable_mamba_shared_prefix_checkpoint``) where they
can act: :func:`shared_prefix_checkpoint` states vLLM's preconditions.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Literal

from hybridpd.config import HybridPDConfig
from hybridpd.errors import ConfigError

logger = logging.getLogger(__name__)

Role = Literal["local", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("local", "prefill", "decode")

#: the EngineArgs / CacheConfig field of vLLM's junction checkpoints (``vllm serve
#: --enable-mamba-shared-prefix-checkpoint``)
SHARED_PREFIX_OPTION = "enable_mamba_shared_prefix_checkpoint"
#: speculative methods vLLM counts as EAGLE (``SpeculativeConfig.use_eagle``)
EAGLE_METHODS = ("eagle", "eagle3", "mtp")
_logged: set[str] = set()


def log_once(message: str, *args: object) -> None:
    """``logger.info`` a message once per process (one engine per process: once per engine)."""
    text = message % args
    if text not in _logged:
        _logged.add(text)
        logger.info("%s", text)


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


def shared_prefix_checkpoint(cfg: HybridPDConfig, role: Role) -> str | None:
    """Whether an engine in ``role`` gets vLLM's junction checkpoints: None if it
    does, else why not (a sentence for the log).

    vLLM 0.32 (``CacheConfig.enable_mamba_shared_prefix_checkpoint``, narrowed in
    ``KVCacheManager.__init__`` and ``Scheduler.__init__``): when a request's
    attention hit reaches past its Mamba-state hit (a sibling shares more of the
    prompt than any saved state covers), vLLM records that length as the
    request's ``shared_prefix_boundary`` (the junction), ends a prefill chunk
    there and keeps the Mamba state at it. Without the option it does the same
    at the junction rounded down to its Mamba block (the scheduler's block, e.g.
    640 tokens for the tiny Qwen3-Next); with it, at the junction itself (a
    multiple of ``prefix_match_unit``). The option takes effect only if all of:

    1. prefix caching with ``mamba_cache_mode="align"`` (we set both together);
    2. partial hash hits: ``prefix_match_unit`` smaller than vLLM's scheduler
       block (vLLM picks that block at start-up; ``VllmEngine`` logs it when
       vLLM turned the option off);
    3. EAGLE on the Mamba group: an EAGLE-family drafter (eagle, eagle3, mtp)
       with its last-block drop on this engine, i.e. ``eagle`` on and a
       ``local`` or ``decode`` engine (a prefill engine has no drafter here);
    4. not multi-module MTP (``method="mtp"`` with ``min(the model's MTP
       layers, num_speculative_tokens) > 1``: its re-prefilled tail is
       excluded); vLLM checks this itself.

    1 and 3 (and our policy) are checked here; 2 and 4 by vLLM (see
    ``VllmEngine.shared_prefix_checkpoint``)."""
    if cfg.checkpoint_policy != "branch-aware":
        return "checkpoint_policy is %s" % cfg.checkpoint_policy
    if not cfg.enable_prefix_caching:
        return "prefix caching is off (vLLM needs mamba_cache_mode=align)"
    if role == "prefill":
        return (
            "a prefill engine runs no EAGLE/MTP drafter, and vLLM checkpoints a junction at its exact"
            " position only on an EAGLE Mamba group (junctions rounded down to vLLM's Mamba block still apply)"
        )
    if not cfg.eagle or cfg.speculative_method not in EAGLE_METHODS:
        return (
            "no EAGLE/MTP speculative decoding (eagle off): vLLM checkpoints a junction at its exact position"
            " only on an EAGLE Mamba group (junctions rounded down to vLLM's Mamba block still apply)"
        )
    return None


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
    store: bool = False,
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.engine.arg_utils.EngineArgs``.

    vLLM's KV and state space is ``vllm_kv_cache_memory_bytes``
    (``kv_cache_memory_bytes``), or ``vllm_kv_cache_blocks`` pages when set
    (``num_gpu_blocks_override``: vLLM allocates exactly that many, whatever the
    bytes say; vLLM 0.32's pages of the tiny Qwen3-Next are 640 tokens, 320 KiB
    on a CPU with AVX512-BF16 and 384 tokens, 192 KiB on one without).
    ``kv_events_endpoint`` (e.g. ``tcp://127.0.0.1:5557``) turns on vLLM's ZMQ
    KV-cache events, which ``hybridpd.engine.vllm.kv_events`` mirrors into the
    prefix index. Under ``checkpoint_policy: branch-aware``
    ``enable_mamba_shared_prefix_checkpoint`` is set where its preconditions
    hold (:func:`shared_prefix_checkpoint`; otherwise absent, and why is
    logged once).
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
        # hybrid models ("align"): a recurrent state exists only at a prefill chunk's end; vLLM
        # keeps those at replay boundaries and junctions, plus every retention interval's
        # multiple (0: none, docs/DESIGN.md "Memory budgets"), at prefix_match_unit
        # granularity within a block (partial-prefix checkpoints)
        kw["mamba_cache_mode"] = "align"
        kw["prefix_match_unit"] = cfg.prefix_match_unit
        kw["prefix_cache_retention_interval"] = cfg.vllm_retention_interval
    kw["kv_cache_memory_bytes"] = cfg.vllm_kv_cache_memory_bytes
    if cfg.vllm_kv_cache_blocks is not None:
        kw["num_gpu_blocks_override"] = cfg.vllm_kv_cache_blocks
    transfer = kv_transfer_config(cfg, role, store)
    if transfer is not None:
        kw["kv_transfer_config"] = transfer
    spec = speculative_config(cfg, role, model_dir)
    if spec is not None:
        kw["speculative_config"] = spec
    why_not = shared_prefix_checkpoint(cfg, role)
    if why_not is None:
        kw[SHARED_PREFIX_OPTION] = True
    else:
        log_once("vLLM junction checkpoints (%s) off for a %s engine: %s", SHARED_PREFIX_OPTION, role, why_not)
    if kv_events_endpoint is not None:
        kw["kv_events_config"] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": kv_events_endpoint,
            "topic": "kv",
        }
    return kw
