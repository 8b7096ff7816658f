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
        self,
        tokens: list[int],
        hidden: torch.Tensor,
        ks: list[int],
        sps: list[SamplingParams],
        gens: list[torch.Generator],
    ) -> list[tuple[list[int], torch.Tensor | None]]:
        """Drafts for a batch of requests: row ``i`` proposes ``ks[i]`` tokens
        after ``tokens[i]`` from target hidden ``hidden[i]``; with sampling also
        each draft distribution (needed for rejection sampling)."""
        n = len(tokens)
        drafts: list[list[int]] = [[] for _ in range(n)]
        dists: list[list[torch.Tensor]] = [[] for _ in range(n)]
        tok = torch.tensor(tokens, device=hidden.device)
        h = hidden
        for step in range(max(ks, default=0)):
            h = self.forward(tok, h)
            logits = self.target.logits(h)
            nxt = torch.argmax(logits, dim=-1).tolist()
            for i in range(n):
                if step >= ks[i]:
                    continue
                if not sampler.is_greedy(sps[i]):
                    p = sampler.probs(logits[i : i + 1], sps[i])[0]
                    dists[i].append(p)
                    nxt[i] = sampler.sample_row(p, gens[i])
                drafts[i].append(nxt[i])
            tok = torch.tensor(nxt, device=hidden.device)
        return [(d, torch.stack(q) if q else None) for d, q in zip(drafts, dists, strict=True)]
