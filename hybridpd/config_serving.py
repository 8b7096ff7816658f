"""The router's configuration fields: its ports, the token channel, API keys and
TLS, request bounds and timeouts.

A field group of :class:`~hybridpd.config.HybridPDConfig`, which inherits it and
validates it with the others in ``config.py``; nothing else builds this class.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class ServingFields(BaseModel):
    """How the router serves (and what it takes from decode)."""

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
