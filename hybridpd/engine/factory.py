"""The one place the ``engine`` config field is read: which engine an actor
runs, and where its model (and tokenizer) live."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from hybridpd.config import HybridPDConfig
from hybridpd.engine.base import Engine

Role = Literal["local", "prefill", "decode"]


def resolve_model(cfg: HybridPDConfig) -> Path | str:
    """The model directory for ``cfg.model`` ('tiny' is engine-specific; built on first use).

    vLLM also accepts a Hugging Face id, returned unchanged."""
    if cfg.engine == "vllm":
        if cfg.model == "tiny":
            from hybridpd.engine.vllm.tiny import resolve

            return resolve()
        return Path(cfg.model) if Path(cfg.model).exists() else cfg.model
    from hybridpd.models.bundled import resolve_model_dir

    return resolve_model_dir(cfg.model)


def make_engine(
    cfg: HybridPDConfig,
    role: Role,
    *,
    instance: str = "local",
    export_checkpoints: bool = False,
    cache_events: bool = False,
    store: tuple[str, str] | None = None,
) -> Engine:
    """The engine ``cfg.engine`` names, in ``role``, typed as the engine boundary.

    ``instance`` names the worker (its NIXL agents); ``export_checkpoints`` makes a
    native prefill engine export partial-prefix checkpoints (``pop_exports``);
    ``cache_events`` makes a vLLM engine publish its KV-cache events, which it turns
    into ``pop_cache_events`` (the native engine always records them); ``store``
    (Mooncake master, metadata URL) gives a vLLM prefill engine the shared prefix store
    through its own connector. A prefill or decode engine under ``cfg.cpu_split()``
    (``cpu_binding``) runs on its role's half of the CPUs (``procs.bind_role_cpus``:
    the calling thread, and the threads it starts afterwards, are bound first)."""
    if role != "local" and cfg.cpu_split():
        from hybridpd.procs import bind_role_cpus

        bind_role_cpus(role)
    if cfg.engine == "vllm":
        from hybridpd.engine.vllm.engine import VllmEngine

        model = Path(resolve_model(cfg))
        return VllmEngine(cfg, model, role, instance=instance, cache_events=cache_events, store=store)
    from hybridpd.engine.native.engine import NativeEngine

    return NativeEngine(
        cfg, Path(resolve_model(cfg)), role=role, instance=instance, export_checkpoints=export_checkpoints
    )
