"""The one place the ``engine`` config field is read: which engine an actor
runs, and where its model (and tokenizer) live."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from hybridpd.config import HybridPDConfig

Role = Literal["local", "prefill", "decode"]


def resolve_model(cfg: HybridPDConfig) -> Path | str:
    """The model directory for ``cfg.model`` ('tiny' is engine-specific; built on first use).

    vLLM also accepts a Hugging Face id, returned unchanged."""
    if cfg.engine == "vllm":
        if cfg.model == "tiny":
            from hybridpd.engine.vllm.tiny import resolve

            return resolve()
        return Path(cfg.model) if Path(cfg.model).exists() else cfg.model
    from hybridpd.engine.native.tiny import resolve_model_dir

    return resolve_model_dir(cfg.model)


def make_engine(
    cfg: HybridPDConfig,
    role: Role,
    *,
    export_checkpoints: bool = False,
    kv_events_endpoint: str | None = None,
    store: tuple[str, str] | None = None,
) -> Any:
    """A ``NativeEngine`` or a ``VllmEngine`` for ``role``; both implement the engine protocol.

    vLLM only: ``kv_events_endpoint`` makes the engine publish its KV-cache events there;
    ``store`` (Mooncake master, metadata URL) gives a prefill engine the shared prefix store."""
    if cfg.engine == "vllm":
        from hybridpd.engine.vllm.engine import VllmEngine

        return VllmEngine(cfg, Path(resolve_model(cfg)), role, kv_events_endpoint=kv_events_endpoint, store=store)
    from hybridpd.engine.native.engine import NativeEngine

    return NativeEngine(cfg, export_checkpoints=export_checkpoints)
