"""The engine's configuration fields: the model, its cache and the checkpoint
protocol, and EAGLE speculative decoding.

Field groups of :class:`~hybridpd.config.HybridPDConfig`, which inherits them
(in this order) and validates them with the others in ``config.py``; nothing
else builds these classes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from hybridpd.engine.vllm.environment import DEFAULT_KV_CACHE_BYTES
from hybridpd.hashing import HashAlgo, default_seed


class EngineFields(BaseModel):
    """The model and how the engine runs it."""

    engine: Literal["native", "vllm"] = Field("native", description="Engine behind every actor.")
    model: str = Field(
        "tiny",
        description="Model: 'tiny' (bundled trained native model), 'tiny-random' (its random-weight sibling),"
        " a directory, or an HF id (vllm).",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Compute dtype; auto: float32 (native), bfloat16 (vllm on cpu: its GDN kernels need it),"
        " the model's own (vllm on cuda).",
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="Device the engine runs on.")
    max_model_len: int = Field(16384, ge=16, le=1 << 20, description="Longest prompt + completion, tokens.")


class CheckpointFields(BaseModel):
    """The prefix cache and the checkpoint protocol (DESIGN section 4)."""

    enable_prefix_caching: bool = Field(True, description="Reuse cached prefixes (local and global).")
    prefix_match_unit: int = Field(16, ge=1, le=65536, description="Hash block size u, tokens.")
    mamba_block_size: int = Field(
        16,
        ge=1,
        le=1 << 20,
        description="State block size B of the checkpoint protocol's slot columns, tokens; a multiple of u"
        " (unset: u). The native engine keys state by chain hash, so B = u adds no layout constraint; a larger"
        " B reproduces vLLM's align-mode column rule.",
    )
    checkpoint_alignment: int | None = Field(
        16, ge=1, le=65536, description="Alignment a of state export offsets; null = the kernel cannot export."
    )
    hash_algo: HashAlgo = Field(HashAlgo.SHA256_CBOR, description="Block hash: sha256_cbor or xxhash_cbor.")
    hash_seed: str = Field(
        default_factory=default_seed, description="Seed of NONE_HASH (default PYTHONHASHSEED, else 'vllm-none-hash')."
    )
    checkpoint_policy: Literal["branch-aware", "tail-only"] = Field(
        "branch-aware",
        description="branch-aware: a prefill also checkpoints the junction the index reports (where the prompt"
        " leaves every known prefix) and, for chat, message boundaries; tail-only: the prompt's tail alone"
        " (positions a client names in hybridpd_checkpoints are honoured either way).",
    )
    max_extra_checkpoints: int = Field(
        4, ge=0, le=8, description="Extra checkpoints (junctions, message ends, client positions) per prefill."
    )
    checkpoint_placement: Literal["value", "geometric", "interval", "off"] = Field(
        "value",
        description="Extra checkpoints along each prompt so a request that diverges from it first still hits"
        " (the router places them, hybridpd/placement.py; on vLLM unless vllm_placement is off): value = the positions"
        " that maximise the expected prefill FLOPs saved, from the divergences the router saw; geometric = the"
        " tail less 2u, 4u, ...; interval = every placement_interval tokens (vLLM's retention interval); off.",
    )
    vllm_placement: bool = Field(
        True,
        description="Also place checkpoints on the vLLM engine, each staged as a prefix prefill (an engine step"
        " and a token each) past what the engine's local cache and MooncakeStore already hold.",
    )
    vllm_stage_tokens: int = Field(
        0,
        ge=0,
        le=1 << 20,
        description="What the engine step a staged checkpoint costs on vLLM is worth, in prefill tokens (a"
        " step's fixed cost is ~120 for the tiny model on 2 CPU cores): checkpoint_placement=value then places"
        " one there only if it also saves this much prefill, counted once per later sharer expected from the"
        " share of prompts that shared a prefix. 0 (default): no price on the step; on vLLM a prompt is still"
        " placed only where one later sharer is expected (it shares a known prefix, or most prompts do).",
    )
    vllm_stage_gap_tokens: int = Field(
        128,
        ge=0,
        le=1 << 20,
        description="On vLLM, a chat message-boundary or junction checkpoint is staged only this many tokens"
        " or more past the hit or the checkpoint kept before it: each staged one costs this request an engine"
        " step (~120 tokens of prefill for the tiny model on 2 CPU cores), and a later request that branches"
        " there saves at most that gap. 0: stage every one (as the native engine writes every one).",
    )
    vllm_tail_stage: bool = Field(
        True,
        description="On a vLLM P/D prefill whose N - 1 truncation drops a unit (N = k u + 1), leave the"
        " prompt's own tail k u after it: a background prefix, one engine step of u + 1 tokens, so the next"
        " turn hits k u as on one engine. Off: the next turn hits one unit lower, as vLLM's own P/D does, and"
        " the step is not spent (on 2 CPU cores it delays the next request that meets it; bench shared-prefix,"
        " stack-vllm-no-tail-stage).",
    )
    vllm_store: bool = Field(
        True,
        description="On vLLM, prefill engines also save every prompt's KV and boundary states to MooncakeStore"
        " and load what it holds (vLLM's MooncakeStoreConnector beside NixlConnector), so a prefix one engine"
        " computed or evicted can be loaded instead of recomputed. Off: each engine keeps only its own prefix"
        " cache, and its host spends no CPU on store lookups and puts (on 2 CPU cores they share the compute"
        " cores: bench shared-prefix, stack-vllm-no-store).",
    )
    vllm_retention_interval: int = Field(
        0,
        ge=0,
        description="vLLM's prefix_cache_retention_interval (tokens, a multiple of vLLM's scheduler block; vLLM"
        " checks it at start): also keep the recurrent state at chunk ends on its multiples. 0 keeps only the"
        " replay boundaries and junctions, which the router's staged checkpoints cover (bench vllm-retention).",
    )
    placement_checkpoints: int = Field(
        2,
        ge=0,
        le=8,
        description="The most placed checkpoints per prefill (value, geometric), besides the others; value"
        " places fewer where they would not pay (placement_min_gain).",
    )
    placement_min_gain: float = Field(
        0.05,
        ge=0,
        lt=1,
        description="checkpoint_placement=value places one more checkpoint only if it adds at least this share"
        " of the prompt's prefill FLOPs to the expected saving (0: always placement_checkpoints).",
    )
    placement_interval: int = Field(
        1024, ge=16, le=1 << 20, description="Interval of checkpoint_placement: interval, tokens."
    )
    placement_share: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Share of state_cache_mb and store_state_budget_mb that placed checkpoints no request"
        " reused yet may hold; past it the least valuable of them is evicted first (0.5: the others keep at"
        " least half).",
    )
    state_cache_mb: float = Field(
        64.0, gt=0, le=1 << 20, description="Recurrent-state checkpoint memory per engine, MiB (native engine)."
    )
    store_state_budget_mb: float = Field(
        1024.0,
        gt=0,
        le=1 << 24,
        description="State-checkpoint bytes each prefill instance may hold in MooncakeStore, MiB; past it the"
        " least valuable of its checkpoints are evicted (DESIGN: checkpoint value).",
    )
    checkpoint_half_life_s: float = Field(
        1800.0, gt=0, le=1 << 24, description="Age at which a checkpoint's value halves (eviction by value)."
    )
    answer_checkpoints: bool = Field(
        True,
        description="When a chat request ends normally, prefill prompt + answer at low priority on the instance"
        " that served it, so the next turn hits the answer too (native engine; per request:"
        " hybridpd_answer_checkpoint).",
    )
    num_kv_blocks: int = Field(4096, ge=16, le=1 << 24, description="Attention KV blocks per engine.")
    vllm_kv_cache_memory_bytes: int = Field(
        DEFAULT_KV_CACHE_BYTES,
        ge=1,
        le=1 << 50,
        description="vLLM's KV and state space per engine, bytes (vllm engine; vLLM's kv_cache_memory_bytes:"
        " attention KV and Mamba states share its pages).",
    )
    vllm_kv_cache_blocks: int | None = Field(
        None,
        ge=1,
        le=1 << 24,
        description="vLLM's KV and state space per engine in pages, whatever vllm_kv_cache_memory_bytes says"
        " (vllm engine; vLLM's num_gpu_blocks_override): a page's bytes depend on the CPU, a page count does"
        " not. null: by bytes.",
    )
    max_num_batched_tokens: int = Field(512, ge=16, le=1 << 20, description="Prefill token budget per step.")
    max_num_seqs: int = Field(64, ge=1, le=4096, description="Running requests per engine.")


class SpeculativeFields(BaseModel):
    """EAGLE speculative decoding."""

    eagle: bool = Field(False, description="EAGLE speculative decoding on decode.")
    num_speculative_tokens: int = Field(3, ge=1, le=16, description="Draft tokens k per step.")
    speculative_method: Literal["eagle", "eagle3", "mtp"] = Field(
        "eagle",
        description="Draft method: eagle (native and vllm), eagle3 or mtp (vllm; mtp uses the model's own MTP layers).",
    )
