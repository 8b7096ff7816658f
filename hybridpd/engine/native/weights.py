"""Seeded weight generation and safetensors I/O for native models.

A model directory holds ``config.json``, ``model.safetensors`` and,
optionally, ``draft.safetensors`` (the EAGLE head) and ``tokenizer.json``.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hybridpd.engine.native.model_config import HybridModelConfig


def init_weights(cfg: HybridModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic fp32 weights for ``cfg`` (CPU RNG, so identical everywhere)."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    hd, inter = cfg.hidden_size, cfg.intermediate_size
    out_std = 1.0 / math.sqrt(hd) / math.sqrt(2 * cfg.num_layers)
    w: dict[str, torch.Tensor] = {
        "embed": normal(cfg.vocab_size, hd, std=1.0),
        "final_norm": torch.ones(hd),
        "lm_head": normal(cfg.vocab_size, hd, std=2.0 / math.sqrt(hd)),
    }
    h, dk, dv = cfg.delta_heads, cfg.delta_key_dim, cfg.delta_value_dim
    for i, kind in enumerate(cfg.layer_types):
        p = "layers.%d." % i
        w[p + "norm1"] = torch.ones(hd)
        w[p + "norm2"] = torch.ones(hd)
        w[p + "mlp.w_gate_up"] = normal(2 * inter, hd, std=1.0 / math.sqrt(hd))
        w[p + "mlp.w_down"] = normal(hd, inter, std=out_std)
        if kind == "D":
            n_in = cfg.conv_dim + h * dk + h + h * dv
            w[p + "mixer.w_in"] = normal(n_in, hd, std=1.0 / math.sqrt(hd))
            w[p + "mixer.conv_w"] = normal(cfg.conv_dim, cfg.conv_kernel, std=1.0 / math.sqrt(cfg.conv_kernel))
            w[p + "mixer.a_log"] = torch.log(torch.empty(h).uniform_(0.5, 2.0, generator=gen))
            dt = torch.exp(torch.empty(h * dk).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
            w[p + "mixer.dt_bias"] = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
            w[p + "mixer.o_norm"] = torch.ones(dv)
            w[p + "mixer.w_o"] = normal(hd, h * dv, std=out_std)
        else:
            n_qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
            w[p + "mixer.w_qkv"] = normal(n_qkv, hd, std=1.0 / math.sqrt(hd))
            w[p + "mixer.w_o"] = normal(hd, cfg.num_heads * cfg.head_dim, std=out_std)
    return w


def init_draft_weights(cfg: HybridModelConfig, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hd, inter = cfg.hidden_size, cfg.draft_intermediate_size
    return {
        "fc": torch.randn(hd, 2 * hd, generator=gen) / math.sqrt(2 * hd),
        "norm_tok": torch.ones(hd),
        "norm_hid": torch.ones(hd),
        "norm_mlp": torch.ones(hd),
        "w_gate_up": torch.randn(2 * inter, hd, generator=gen) / math.sqrt(hd),
        "w_down": torch.randn(hd, inter, generator=gen) / math.sqrt(inter) * 0.1,
    }


def weights_digest(weights: dict[str, torch.Tensor]) -> str:
    """sha256 over names and bytes: identifies the exact target weights."""
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode())
        h.update(weights[name].contiguous().float().numpy().tobytes())
    return h.hexdigest()


def save_weights(path: Path, weights: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path), metadata=metadata)


def load_weights(path: Path, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device=device, dtype=dtype) for k, v in load_file(str(path)).items()}
