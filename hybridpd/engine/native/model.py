"""The hybrid decoder: embeddings, delta/attention mixers, SwiGLU MLPs, head.

``forward`` advances a batch of :class:`Work` items (one per request) by one
step: continuous batching, where each item is a prefill chunk or a run of
decode tokens. Mixers run per item (they own per-request state); the MLP and
head run over all rows at once (row-exact, see ``ops.rows_mm``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridpd.engine.native.attention import AttentionLayer
from hybridpd.engine.native.delta import DeltaLayer, DeltaState
from hybridpd.engine.native.model_config import HybridModelConfig
from hybridpd.engine.native.ops import Rope, rms_norm, rows_mm, swiglu


@dataclass(slots=True)
class Work:
    """One request's share of a step. Inputs first, outputs filled by forward."""

    tokens: torch.Tensor  # [n] long
    start: int  # absolute position of tokens[0]
    block_table: list[int]
    delta: list[DeltaState]  # per delta layer; replaced by the state after the step
    decode: bool
    snapshot_at: frozenset[int] = frozenset()
    hidden: torch.Tensor | None = None  # [n, hidden] final residual stream (pre-norm)
    snapshots: dict[int, list[DeltaState]] = field(default_factory=dict)  # prefill: pos -> per-layer state
    token_states: list[list[DeltaState]] = field(default_factory=list)  # decode: per token -> per-layer state


class HybridModel:
    def __init__(self, cfg: HybridModelConfig, weights: dict[str, torch.Tensor], device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        w = weights
        self.embed = w["embed"]
        self.final_norm = w["final_norm"]
        self.lm_head = w["lm_head"]
        rope = Rope(cfg.head_dim, cfg.max_position, cfg.rope_theta, device)
        self.mixers: list[DeltaLayer | AttentionLayer] = []
        self.norms: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.mlps: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, kind in enumerate(cfg.layer_types):
            sub = {k.split(".", 2)[2]: v for k, v in w.items() if k.startswith("layers.%d." % i)}
            if kind == "D":
                self.mixers.append(DeltaLayer(cfg, {k[6:]: v for k, v in sub.items() if k.startswith("mixer.")}))
            else:
                self.mixers.append(
                    AttentionLayer(cfg, {k[6:]: v for k, v in sub.items() if k.startswith("mixer.")}, rope)
                )
            self.norms.append((sub["norm1"], sub["norm2"]))
            self.mlps.append((sub["mlp.w_gate_up"], sub["mlp.w_down"]))
        self.delta_layers = [i for i, k in enumerate(cfg.layer_types) if k == "D"]
        self.attn_layers = [i for i, k in enumerate(cfg.layer_types) if k == "A"]
        self.dtype = self.embed.dtype

    def empty_state(self) -> list[DeltaState]:
        return [self.mixers[i].empty_state(self.device) for i in self.delta_layers]  # type: ignore[union-attr]

    def forward(self, works: list[Work], kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Run one step for every item; ``kv_caches`` is per attention layer."""
        tokens = torch.cat([w.tokens for w in works]).to(self.device)
        x = self.embed[tokens]
        bounds = [0]
        for w in works:
            bounds.append(bounds[-1] + w.tokens.numel())
        for w in works:
            if w.decode:
                w.token_states = [[] for _ in range(w.tokens.numel())]
        positions = torch.cat([torch.arange(w.start, w.start + w.tokens.numel()) for w in works]).to(self.device)
        for li, mixer in enumerate(self.mixers):
            norm1, norm2 = self.norms[li]
            h = rms_norm(x, norm1, self.cfg.rms_eps)
            if isinstance(mixer, DeltaLayer):
                out = self._delta_layer(mixer, self.delta_layers.index(li), h, works, bounds)
            else:
                out = self._attention_layer(mixer, kv_caches[self.attn_layers.index(li)], h, positions, works, bounds)
            x = x + out
            x = x + swiglu(rms_norm(x, norm2, self.cfg.rms_eps), *self.mlps[li])
        for wi, w in enumerate(works):
            w.hidden = x[bounds[wi] : bounds[wi + 1]]

    @staticmethod
    def _delta_layer(mixer: DeltaLayer, di: int, h: torch.Tensor, works: list[Work], bounds: list[int]) -> torch.Tensor:
        proj = mixer.project(h)
        os, zs = [], []
        for wi, w in enumerate(works):
            p = proj[bounds[wi] : bounds[wi + 1]]
            if w.decode:
                o, z, states = mixer.decode_core(p, w.delta[di])
                for t, st in enumerate(states):
                    w.token_states[t].append(st)
                w.delta[di] = states[-1]
            else:
                o, z, new_state, snaps = mixer.prefill_core(p, w.start, w.delta[di], w.snapshot_at)
                w.delta[di] = new_state
                for pos, st in snaps.items():
                    w.snapshots.setdefault(pos, []).append(st)
            os.append(o)
            zs.append(z)
        return mixer.output(torch.cat(os), torch.cat(zs), h.dtype)

    @staticmethod
    def _attention_layer(
        mixer: AttentionLayer,
        cache: tuple[torch.Tensor, torch.Tensor],
        h: torch.Tensor,
        positions: torch.Tensor,
        works: list[Work],
        bounds: list[int],
    ) -> torch.Tensor:
        q, k, v = mixer.qkv(h, positions)
        outs = []
        for wi, w in enumerate(works):
            sl = slice(bounds[wi], bounds[wi + 1])
            fn = mixer.decode_core if w.decode else mixer.prefill_core
            outs.append(fn(q[sl], k[sl], v[sl], w.start, cache, w.block_table))
        return mixer.output(torch.cat(outs))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits for rows of final hidden states."""
        return rows_mm(rms_norm(hidden, self.final_norm, self.cfg.rms_eps), self.lm_head).float()
