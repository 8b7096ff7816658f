"""EAGLE draft head: one decoder layer over [token embedding ; target hidden].

    f = fc([rmsnorm(embed(x_{t+1})) ; rmsnorm(h_t)])      (2H -> H)
    f = f + SwiGLU(rmsnorm(f))                            (the decoder layer)
    logits = target.lm_head(target.final_norm(f))

``f`` stands in for the target's next hidden state, so the head chains k
steps from the target hidden at the last computed position. The layer is
attention-free: the target hidden already carries the context, and the draft
state handed from prefill to decode is then one hidden vector (DraftState).
The embedding and LM head are shared with the target.
"""

from __future__ import annotations

import torch

from hybridpd.engine.base import SamplingParams
from hybridpd.engine.native import sampler
from hybridpd.engine.native.model import HybridModel
from hybridpd.engine.native.ops import rms_norm, rows_mm, swiglu


class DraftHead:
    def __init__(self, target: HybridModel, weights: dict[str, torch.Tensor]) -> None:
        self.target = target
        self.w = weights
        self.eps = target.cfg.rms_eps

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Next draft hidden for rows of (token, previous hidden)."""
        w = self.w
        e = rms_norm(self.target.embed[tokens], w["norm_tok"], self.eps)
        h = rms_norm(hidden, w["norm_hid"], self.eps)
        f = rows_mm(torch.cat([e, h], dim=-1), w["fc"])
        return f + swiglu(rms_norm(f, w["norm_mlp"], self.eps), w["w_gate_up"], w["w_down"])

    @torch.inference_mode()
    def propose(
        self, token: int, hidden: torch.Tensor, k: int, sp: SamplingParams, gen: torch.Generator
    ) -> tuple[list[int], torch.Tensor | None]:
        """``k`` draft tokens following ``token``; with sampling also the draft
        distribution of each (needed for rejection sampling)."""
        drafts: list[int] = []
        dists = []
        h = hidden[None]
        tok = torch.tensor([token], device=hidden.device)
        for _ in range(k):
            h = self.forward(tok, h)
            logits = self.target.logits(h)[0]
            if sampler.is_greedy(sp):
                nxt = int(torch.argmax(logits).item())
            else:
                p = sampler.probs(logits[None], sp)[0]
                dists.append(p)
                nxt = sampler.sample_row(p, gen)
            drafts.append(nxt)
            tok = torch.tensor([nxt], device=hidden.device)
        return drafts, (torch.stack(dists) if dists else None)
