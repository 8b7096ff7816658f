"""The deployment's configuration fields: the external services a stack uses
(Redis, the Mooncake master, Ray) and its topology (actors, placement, GPUs, CPUs).

A field group of :class:`~hybridpd.config.HybridPDConfig`, which inherits it and
validates it with the others in ``config.py``; nothing else builds this class.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class DeploymentFields(BaseModel):
    """External services (unset: the local stack starts its own), then the topology."""

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
