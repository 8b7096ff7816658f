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
from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from hybridpd.config_deployment import DeploymentFields
from hybridpd.config_engine import CheckpointFields, EngineFields, SpeculativeFields
from hybridpd.config_serving import ServingFields
from hybridpd.engine.profile import profile_of
from hybridpd.errors import ConfigError
from hybridpd.hashing import HashAlgo

ENV_PREFIX = "HYBRIDPD_"
_NONE_WORDS = frozenset({"", "none", "null"})
Port = Field(ge=1, le=65535)


class HybridPDConfig(DeploymentFields, ServingFields, SpeculativeFields, CheckpointFields, EngineFields):
    """Effective configuration. Frozen: build a new one to change it.

    Its fields, in this order: ``EngineFields``, ``CheckpointFields``,
    ``SpeculativeFields`` (``config_engine.py``), ``ServingFields``
    (``config_serving.py``), ``DeploymentFields`` (``config_deployment.py``);
    every check across them is here."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False)

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
