"""EAGLE draft head: one decoder layer over [token embedding ; target hidden].

    f = fc([rmsnorm(embed(x_{t+1})) ; rmsnorm(h_t)])      (2H -> H)
    f = f + SwiGLU(rmsnorm(f))                            (the decoder layer)
    logits = target.lm_head(target.final_norm(f))

``f`` stands in for the target's next hidden state, so the head chains k
steps from the target hidden at the last computed position. The layer is
attention-free: the target hidden already carries the context, and the draft
state handed from prefill to decode is then one hidden vector (DraftState).
The embedding and LM head are shared with the target.

The draft's matmuls are plain ``x @ w.T`` over its real rows, not
``rows_mm`` (padded to 16 rows for batch invariance): a proposal only picks
which tokens the target verifies, and verification is exact, so the draft
needs no row invariance, and at batch 1 its step (3 matmuls + the LM head)
multiplies one row where padding would multiply 16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridpd.engine.base import SamplingParams
from hybridpd.engine.native import sampler
from hybridpd.engine.native.model import HybridModel
from hybridpd.engine.native.ops import rms_norm


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
        f = torch.cat([e, h], dim=-1) @ w["fc"].T
        gate, up = (rms_norm(f, w["norm_mlp"], self.eps) @ w["w_gate_up"].T).chunk(2, dim=-1)
        return f + (F.silu(gate) * up) @ w["w_down"].T

    def logits(self, f: torch.Tensor) -> torch.Tensor:
        """fp32 draft logits through the target's final norm and LM head."""
        t = self.target
        return (rms_norm(f, t.final_norm, self.eps) @ t.lm_head.T).float()

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
            logits = self.logits(h)
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
