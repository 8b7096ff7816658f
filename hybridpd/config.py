# Over 350 lines: every configuration field with its bounds and help, validated in one place.
"""The one typed configuration of hybridpd, built once and validated here.

Precedence (later wins): defaults < YAML file < ``HYBRIDPD_<FIELD>`` env vars
< CLI flags (``--<field-name>``). Every source goes through
:func:`load_config`; any bad value raises :class:`~hybridpd.errors.ConfigError`
naming the field and the allowed range. The YAML format is flat: the keys are
the field names below (``hybridpd config show`` prints a valid file).
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hybridpd.engine.profile import profile_of
from hybridpd.errors import ConfigError
from hybridpd.hashing import HashAlgo, default_seed

ENV_PREFIX = "HYBRIDPD_"
_NONE_WORDS = frozenset({"", "none", "null"})
Port = Field(ge=1, le=65535)


class HybridPDConfig(BaseModel):
    """Effective configuration. Frozen: build a new one to change it."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False)

    # -- model and engine
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

    # -- cache and the checkpoint protocol
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
    max_num_batched_tokens: int = Field(512, ge=16, le=1 << 20, description="Prefill token budget per step.")
    max_num_seqs: int = Field(64, ge=1, le=4096, description="Running requests per engine.")

    # -- EAGLE speculative decoding
    eagle: bool = Field(False, description="EAGLE speculative decoding on decode.")
    num_speculative_tokens: int = Field(3, ge=1, le=16, description="Draft tokens k per step.")
    speculative_method: Literal["eagle", "eagle3", "mtp"] = Field(
        "eagle",
        description="Draft method: eagle (native and vllm), eagle3 or mtp (vllm; mtp uses the model's own MTP layers).",
    )

    # -- serving
    host: str = Field("127.0.0.1", description="Bind address of the router.")
    http_port: int = Field(8000, ge=1, le=65535, description="OpenAI-compatible HTTP port.")
    grpc_port: int = Field(50051, ge=1, le=65535, description="gRPC port.")
    dashboard_port: int = Field(8265, ge=1, le=65535, description="Ray dashboard port (local stack).")
    routing: Literal["cache_aware", "round_robin"] = Field(
        "cache_aware", description="cache_aware: cost over hits and load; round_robin: ignore the index."
    )
    token_channel: Literal["zmq", "ray"] = Field(
        "zmq",
        description="How decode actors stream tokens to the router: zmq (one socket per actor and router,"
        " no Ray object per token) or ray (a Ray streaming generator per request: a Ray object per chunk).",
    )
    token_sink_host: str = Field(
        "127.0.0.1",
        description="Address the router's token sink binds and decode actors send to (token_channel zmq);"
        " 'auto' = the router's Ray node IP.",
    )
    decode_affinity_slack: int = Field(
        4,
        ge=1,
        description="Decode affinity: a conversation's next turn goes to the decode instance holding its "
        "previous turns (it reads only the new blocks), unless that one decodes this many more requests "
        "than the least busy; then the least busy takes it.",
    )
    ray_metrics_port: int = Field(
        8090, ge=1, le=65535, description="Port of Ray's Prometheus endpoint (actor metrics), local stack."
    )
    fault_injection: bool = Field(
        False, description="Enable POST /v1/hybridpd/faults (tests only; never in production)."
    )
    api_keys: list[str] = Field(
        default_factory=list,
        description="Bearer API keys (comma-separated in env/flags); each is a tenant. Empty: off.",
    )
    api_keys_file: str | None = Field(
        None,
        description="File of Bearer API keys, one per line ('#' comments); each is a tenant. Read again when"
        " it changes. Adds to api_keys.",
    )
    operator_api_keys: list[str] = Field(
        default_factory=list,
        description="Operator keys (comma-separated): the only keys /v1/hybridpd/* and the hybridpd_* usage"
        " details answer to.",
    )
    operator_api_keys_file: str | None = Field(
        None, description="File of operator keys, one per line; read again when it changes."
    )
    cache_details: Literal["operator", "everyone", "off"] = Field(
        "operator",
        description="Who sees the hybridpd_* usage fields (why prompt tokens hit or not): operator keys,"
        " everyone (an open loopback stack), or no one.",
    )
    metrics_need_key: bool = Field(False, description="GET /metrics answers operator keys only.")
    drain_grace_s: float = Field(
        120.0,
        ge=0,
        le=86400,
        description="On SIGTERM (or Ctrl-C) the router admits nothing new and waits this long at most for the"
        " requests in flight to finish before it stops (a second signal stops it at once).",
    )
    integrity_key_file: str | None = Field(
        None,
        description="File holding the deployment key (a mounted Secret; at least 16 bytes): store objects,"
        " handoff descriptors and decode's token frames carry HMAC-SHA256 tags made with it, and the native"
        " engine's block-hash seed derives from it. Unset: hybridpd up writes a random one for a local stack"
        " (actor_placement any) in its workdir; elsewhere a public key, which stops accidents only.",
    )
    max_token_frame_bytes: int = Field(
        1 << 20,
        ge=4096,
        le=1 << 30,
        description="Largest token frame the router's sink takes from decode (token_channel zmq); a larger one"
        " is refused and counted, and decode splits a chunk that would not fit.",
    )
    allow_anonymous: bool = Field(
        False,
        description="Serve without API keys off loopback (anyone who reaches host may call the API);"
        " without it, a non-loopback host needs api_keys or api_keys_file.",
    )
    tls_cert_file: str | None = Field(None, description="PEM certificate: HTTP and gRPC serve TLS with it.")
    tls_key_file: str | None = Field(None, description="PEM private key of tls_cert_file.")
    http_max_connections: int = Field(
        1024, ge=1, le=1_000_000, description="Open HTTP connections the router keeps; then 503."
    )
    http_keepalive_timeout_s: float = Field(5.0, gt=0, le=3600, description="Idle HTTP keep-alive connections close.")
    http_header_timeout_s: float = Field(
        10.0, gt=0, le=3600, description="A connection that has not sent its request headers by then is closed."
    )
    grpc_max_message_bytes: int = Field(
        8 << 20, ge=1024, le=1 << 30, description="Largest gRPC request message (RESOURCE_EXHAUSTED beyond)."
    )
    max_stop_strings: int = Field(4, ge=0, le=64, description="Stop strings per request (vLLM's 4).")
    max_stop_chars: int = Field(256, ge=1, le=65536, description="Characters of one stop string.")
    max_prompt_chars: int = Field(
        4 << 20, ge=1, le=1 << 30, description="Characters of a prompt (all messages of a chat) before tokenizing."
    )
    max_messages: int = Field(2048, ge=1, le=1_000_000, description="Messages of one chat request.")
    max_choices: int = Field(16, ge=1, le=1024, description="Choices of one request: n times its prompts.")
    tokenizer_threads: int = Field(
        2, ge=1, le=256, description="Threads that tokenize and render chat templates, after admission."
    )
    max_inflight_requests: int = Field(256, ge=1, le=100000, description="Router admits this many; then 429.")
    request_timeout_s: float = Field(600.0, gt=0, le=86400, description="Deadline of one request (504 after).")
    handoff_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="Prefill frees a handoff decode has not read by then (router re-prefills)."
    )

    # -- external services (unset: the local stack starts its own)
    redis_url: str | None = Field(None, description="Redis URL of the prefix index, e.g. redis://:pw@host:port/0.")
    redis_cluster: bool = Field(
        False,
        description="redis_url names a node of a Redis Cluster (>= 6.2); a model's index keys share one hash slot.",
    )
    redis_read_replicas: bool = Field(
        False,
        description="The router's lookups read a replica (stale by the replication lag; one whose link to its"
        " primary is down, or that fails, is skipped for the primary): on a Redis Cluster the replicas of the"
        " model's shard, else redis_replica_url. Writes always go to the primary.",
    )
    redis_replica_url: str | None = Field(
        None,
        description="A replica of redis_url (one Redis, not a cluster) that lookups read with redis_read_replicas.",
    )
    mooncake_master: str | None = Field(None, description="Mooncake master host:port (its RPC port).")
    mooncake_metadata_url: str | None = Field(
        None, description="Mooncake HTTP metadata URL; default http://<master host>:8080/metadata."
    )
    ray_address: str | None = Field(None, description="Ray cluster address; unset starts a local head.")

    # -- topology
    num_prefill: int = Field(2, ge=1, le=256, description="Prefill actors.")
    num_decode: int = Field(1, ge=1, le=256, description="Decode actors.")
    actor_placement: Literal["any", "worker_groups"] = Field(
        "any",
        description="any: actors go anywhere (local stack); worker_groups: each prefill/decode actor needs one"
        " unit of the Ray custom resource prefill_resource/decode_resource (the Helm chart's worker groups, or"
        " nodes started with `ray start --resources`) and is detached, shared by every router replica.",
    )
    prefill_resource: str = Field(
        "hybridpd_prefill",
        pattern=r"^[A-Za-z0-9_.\-]+$",
        description="Ray custom resource a prefill actor needs one unit of (worker_groups placement).",
    )
    decode_resource: str = Field(
        "hybridpd_decode",
        pattern=r"^[A-Za-z0-9_.\-]+$",
        description="Ray custom resource a decode actor needs one unit of (worker_groups placement).",
    )
    actor_num_gpus: float = Field(0.0, ge=0, le=16, description="GPUs each prefill/decode actor reserves in Ray.")
    decode_num_gpus: float | None = Field(
        None, ge=0, le=16, description="GPUs each decode actor reserves (null: actor_num_gpus, as prefill actors)."
    )
    cpu_binding: Literal["auto", "split", "off"] = Field(
        "auto",
        description="Give prefill and decode actors their own CPUs, as P/D gives them their own devices: split"
        " binds a prefill actor's engine to the first half of the CPUs its process may use and a decode actor's"
        " to the second half (nothing with one CPU); auto: split for the vLLM engine on device cpu with"
        " actor_placement any (both roles on one machine: vllm serve binds its CPU engines too), else off.",
    )
    store_host: str = Field(
        "127.0.0.1",
        description="Address the MooncakeStore client of each prefill actor advertises; 'auto' = the Ray node IP.",
    )

    def cpu_split(self) -> bool:
        """``cpu_binding`` resolved: whether actors bind their engines to their role's CPUs."""
        if self.cpu_binding == "auto":
            return profile_of(self).auto_cpu_split and self.device == "cpu" and self.actor_placement == "any"
        return self.cpu_binding == "split"

    @model_validator(mode="before")
    @classmethod
    def _block_follows_unit(cls, data: Any) -> Any:
        """``mamba_block_size`` unset: ``prefix_match_unit`` (B = u)."""
        if isinstance(data, dict) and data.get("mamba_block_size") is None and "prefix_match_unit" in data:
            data = {**data, "mamba_block_size": data["prefix_match_unit"]}
        return data

    @field_validator("api_keys", "operator_api_keys", mode="before")
    @classmethod
    def _split_keys(cls, v: object) -> object:
        if isinstance(v, str):
            return [k.strip() for k in v.split(",") if k.strip()]
        return v

    @model_validator(mode="after")
    def _cross_field(self) -> HybridPDConfig:
        if self.mamba_block_size % self.prefix_match_unit != 0:
            raise ConfigError(
                "mamba_block_size",
                "must be a multiple of prefix_match_unit (%d), got %d"
                % (self.prefix_match_unit, self.mamba_block_size),
            )
        if self.checkpoint_placement == "interval" and self.placement_interval % self.prefix_match_unit != 0:
            raise ConfigError(
                "placement_interval",
                "must be a multiple of prefix_match_unit (%d), got %d"
                % (self.prefix_match_unit, self.placement_interval),
            )
        if self.device == "cuda" and self.actor_placement == "worker_groups":
            for field, role in (("actor_num_gpus", "prefill"), ("decode_num_gpus", "decode")):
                if self.num_gpus(role) == 0:
                    raise ConfigError(field, "must be > 0 when device is cuda on Ray worker groups")
        for name, instead in profile_of(self).unread_config:
            if getattr(self, name) != type(self).model_fields[name].default:
                raise ConfigError(
                    name, "the %s engine does not read it: %s; leave it at its default" % (self.engine, instead)
                )
        methods = profile_of(self).speculative_methods
        if self.speculative_method not in methods:
            raise ConfigError(
                "speculative_method",
                "the %s engine implements %s only, got %r"
                % (self.engine, ", ".join(sorted(methods)), self.speculative_method),
            )
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigError("tls_key_file", "tls_cert_file and tls_key_file go together")
        files = ("tls_cert_file", "tls_key_file", "api_keys_file", "operator_api_keys_file", "integrity_key_file")
        for name in files:
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ConfigError(name, "no such file: %s" % path)
        if not (self.api_keys or self.api_keys_file or self.allow_anonymous or is_loopback(self.host)):
            raise ConfigError(
                "host",
                "%s is not loopback: set api_keys or api_keys_file, or allow_anonymous to serve anyone who"
                " reaches it" % self.host,
            )
        if self.http_port == self.grpc_port:
            raise ConfigError("grpc_port", "must differ from http_port (%d)" % self.http_port)
        if self.mooncake_master is not None and not _is_host_port(self.mooncake_master):
            raise ConfigError("mooncake_master", "must be host:port, got %r" % self.mooncake_master)
        if self.mooncake_metadata_url is not None and not self.mooncake_metadata_url.startswith(
            ("http://", "https://")
        ):
            raise ConfigError("mooncake_metadata_url", "must be an http(s) URL, got %r" % self.mooncake_metadata_url)
        if self.redis_url is not None and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError("redis_url", "must start with redis://, rediss:// or unix://, got %r" % self.redis_url)
        for name in ("prefill_resource", "decode_resource"):
            if getattr(self, name) in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ConfigError(name, "must be a custom resource, not Ray's built-in %r" % getattr(self, name))
        if self.prefill_resource == self.decode_resource:
            raise ConfigError("decode_resource", "must differ from prefill_resource (%r)" % self.prefill_resource)
        if self.redis_replica_url is not None and not self.redis_replica_url.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ConfigError(
                "redis_replica_url", "must start with redis://, rediss:// or unix://, got %r" % self.redis_replica_url
            )
        if self.redis_read_replicas and self.redis_url is None:
            raise ConfigError(
                "redis_read_replicas", "needs redis_url (a Redis with replicas); the local stack starts one Redis"
            )
        if self.redis_read_replicas and not self.redis_cluster and self.redis_replica_url is None:
            raise ConfigError(
                "redis_read_replicas", "needs redis_replica_url, or redis_cluster (a cluster names its replicas)"
            )
        if self.redis_replica_url is not None and self.redis_cluster:
            raise ConfigError(
                "redis_replica_url", "a Redis Cluster names its replicas itself: unset it, keep redis_read_replicas"
            )
        if self.redis_replica_url is not None and not self.redis_read_replicas:
            raise ConfigError("redis_replica_url", "is read only with redis_read_replicas: set that too")
        if self.redis_cluster and self.redis_url is None:
            raise ConfigError(
                "redis_cluster", "needs redis_url (a node of the cluster); the local stack starts one Redis"
            )
        if (
            self.redis_cluster
            and self.redis_url is not None
            and not re.search(r"^[a-z]+://[^/?]*(/0?)?(\?.*)?$", self.redis_url)
        ):
            raise ConfigError(
                "redis_cluster", "a Redis Cluster has database 0 only: end redis_url with /0 or no database"
            )
        return self

    def num_gpus(self, role: str) -> float:
        """GPUs an actor of ``role`` ("prefill" or "decode") reserves in Ray."""
        if role == "decode" and self.decode_num_gpus is not None:
            return self.decode_num_gpus
        return self.actor_num_gpus

    def engine_dtype(self) -> str:
        """``dtype`` with 'auto' resolved for the engine (its profile's ``default_dtype``;
        vLLM on CUDA keeps 'auto': the model's own)."""
        return self.dtype if self.dtype != "auto" else profile_of(self).default_dtype

    def metadata_url(self) -> str | None:
        """The Mooncake metadata URL for an external master (None: local stack)."""
        if self.mooncake_metadata_url or not self.mooncake_master:
            return self.mooncake_metadata_url
        return "http://%s:8080/metadata" % self.mooncake_master.rpartition(":")[0]

    def to_yaml(self, redact: bool = False) -> str:
        """The effective config as a YAML file :func:`load_config` accepts
        (``redact`` hides API keys, for display)."""
        data = self.model_dump(mode="json")
        if redact and data["api_keys"]:
            data["api_keys"] = ["<redacted>"] * len(data["api_keys"])
        return yaml.safe_dump(data, sort_keys=False)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_host_port(value: str) -> bool:
    host, sep, port = value.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


def allowed(field: str) -> str:
    """Human text for the values ``field`` accepts (used in errors and --help)."""
    info = HybridPDConfig.model_fields[field]
    ann = info.annotation
    choices = get_args(ann) if getattr(ann, "__origin__", None) is Literal else ()
    if choices:
        return "one of " + ", ".join(repr(c) for c in choices)
    if ann is HashAlgo:
        return "one of " + ", ".join(repr(a.value) for a in HashAlgo)
    lo = hi = None
    for meta in info.metadata:
        lo = getattr(meta, "ge", lo)
        hi = getattr(meta, "le", hi)
    if lo is not None or hi is not None:
        return "an integer in [%s, %s]%s" % (lo, hi, " or null" if "None" in str(ann) else "")
    if ann is bool:
        return "true or false"
    return "a string" + (" or null" if "None" in str(ann) else "")


def _raise_config_error(err: ValidationError) -> None:
    first = err.errors()[0]
    loc = first.get("loc") or ("<config>",)
    field = str(loc[0])
    if first.get("type") == "extra_forbidden":
        raise ConfigError(field, "unknown field; known fields: %s" % ", ".join(HybridPDConfig.model_fields)) from None
    ctx_err = (first.get("ctx") or {}).get("error")
    if isinstance(ctx_err, ConfigError):
        raise ctx_err from None
    raise ConfigError(
        field, "%s (got %r); allowed: %s" % (first.get("msg"), first.get("input"), allowed(field))
    ) from None


def _normalize(field: str, value: Any) -> Any:
    """Map textual nulls to None for nullable fields (env vars, CLI)."""
    if isinstance(value, str) and value.strip().lower() in _NONE_WORDS:
        ann = str(HybridPDConfig.model_fields[field].annotation)
        if "None" in ann:
            return None
    return value


def env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """``HYBRIDPD_<FIELD>`` variables that name a config field."""
    out: dict[str, Any] = {}
    for name in HybridPDConfig.model_fields:
        key = ENV_PREFIX + name.upper()
        if key in env:
            out[name] = env[key]
    return out


def load_config(
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> HybridPDConfig:
    """Build and validate the effective config from its sources.

    ``env`` defaults to ``os.environ``; ``overrides`` are CLI flag values
    (``None`` values are ignored). Raises ``ConfigError``.
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            loaded = yaml.safe_load(p.read_text())
        except OSError as exc:
            raise ConfigError("config", "cannot read %s: %s" % (p, exc)) from None
        except yaml.YAMLError as exc:
            raise ConfigError("config", "%s is not valid YAML: %s" % (p, exc)) from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError("config", "%s must hold a mapping of field: value" % p)
        data.update(loaded)
    data.update(env_overrides(os.environ if env is None else env))
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    data = {k: (_normalize(k, v) if k in HybridPDConfig.model_fields else v) for k, v in data.items()}
    try:
        return HybridPDConfig(**data)
    except ValidationError as err:
        _raise_config_error(err)
        raise  # unreachable: _raise_config_error always raises
