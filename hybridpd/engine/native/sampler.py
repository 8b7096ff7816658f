"""Token selection: greedy (exact), sampling, and EAGLE verification.

Greedy verification accepts drafts while they equal the target's argmax, so
EAGLE on and off emit identical greedy tokens. With temperature > 0 it is
standard speculative rejection sampling (accept y with probability
``min(1, p(y) / q(y))``, else resample from ``max(p - q, 0)``), which keeps the
target distribution exactly.
"""

from __future__ import annotations

import torch

from hybridpd.engine.base import SamplingParams

#: a temperature below this is greedy (vLLM's ``_SAMPLING_EPS``)
GREEDY_EPS = 1e-5


def is_greedy(sp: SamplingParams) -> bool:
    return sp.temperature < GREEDY_EPS


def probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Sampling distribution per row after temperature, min-p, top-k and top-p."""
    x = logits.float() / max(sp.temperature, 1e-6)
    if sp.min_p > 0.0:  # vLLM's order: after temperature, before top-k and top-p
        p0 = torch.softmax(x, dim=-1)
        x = x.masked_fill(p0 < sp.min_p * p0.max(dim=-1, keepdim=True).values, float("-inf"))
    if sp.top_k and sp.top_k < x.shape[-1]:
        kth = torch.topk(x, sp.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if 0.0 < sp.top_p < 1.0:
        sorted_p, idx = torch.sort(p, dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < sp.top_p
        keep[..., 0] = True  # the top token always stays (a top_p below float32's tiny would drop it)
        sorted_p = sorted_p * keep
        p = torch.zeros_like(p).scatter(-1, idx, sorted_p)
        p = p / p.sum(-1, keepdim=True)
    return p


def sample_row(p: torch.Tensor, gen: torch.Generator) -> int:
    """One draw from ``p`` with the request's (CPU) generator, whatever the device."""
    return int(torch.multinomial(p.float().cpu(), 1, generator=gen).item())


def pick(logits: torch.Tensor, sp: SamplingParams, gen: torch.Generator) -> int:
    """One token from one row of logits."""
    if is_greedy(sp):
        return int(torch.argmax(logits).item())
    return sample_row(probs(logits[None], sp)[0], gen)


def verify(
    target_logits: torch.Tensor,
    drafts: list[int],
    draft_probs: torch.Tensor | None,
    sp: SamplingParams,
    gen: torch.Generator,
) -> list[int]:
    """Tokens to emit after checking ``drafts`` (k) against the target's
    ``k + 1`` rows of logits: the accepted drafts, then one target token."""
    if is_greedy(sp):
        target = torch.argmax(target_logits, dim=-1).tolist()
        m = 0
        while m < len(drafts) and drafts[m] == target[m]:
            m += 1
        return [*drafts[:m], target[m]]
    assert draft_probs is not None
    p = probs(target_logits, sp)
    out: list[int] = []
    for i, y in enumerate(drafts):
        q_y = float(draft_probs[i, y])
        accept = float(torch.rand((), generator=gen)) < min(1.0, float(p[i, y]) / max(q_y, 1e-20))
        if accept:
            out.append(y)
            continue
        residual = torch.clamp(p[i] - draft_probs[i], min=0.0)
        total = float(residual.sum())
        out.append(sample_row(residual / total, gen) if total > 0 else sample_row(p[i], gen))
        return out
    out.append(sample_row(p[len(drafts)], gen))
    return out
